"""Planning from data: arrival forecasts and their backtest, capacity plans, and ``tailguard advise``.
"""
