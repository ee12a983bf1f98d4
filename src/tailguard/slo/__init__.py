"""SLO monitor: profiles (S1), sliding windows (S2), evaluation and tiered alerts, actions (S3), rule export and reports.

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
