"""Planning from data: arrival forecasts and their backtest (E1, M4), capacity plans, and ``tailguard advise`` (C2, M2).
"""
