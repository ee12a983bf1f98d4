"""SLO monitor: profiles, sliding windows, evaluation and tiered alerts, actions, rule export and reports.

Import the light pieces from here; the monitor itself lives in :mod:`tailguard.slo.monitor`.
"""

from tailguard.slo.profiles import (
    BUILTIN_PROFILES,
    Metric,
    Objective,
    ProfileError,
    RequestBound,
    Selector,
    SLOProfile,
    builtin_profiles,
    get_profile,
    load_profiles,
    parse_profiles,
    profile_names,
)

__all__ = [
    "BUILTIN_PROFILES",
    "Metric",
    "Objective",
    "ProfileError",
    "RequestBound",
    "Selector",
    "SLOProfile",
    "builtin_profiles",
    "get_profile",
    "load_profiles",
    "parse_profiles",
    "profile_names",
]
