"""Device profiles: the schema, the built-in TOML profiles and the planner (profile → plan).

Torch-free: the planner sizes models with :mod:`fedge.common.archs`.
"""

from fedge.profiles.loader import builtin_dir, dump_profile, list_profiles, load_profile, parse_profile
from fedge.profiles.planner import Plan, plan
from fedge.profiles.schema import Budgets, Hardware, Measured, Network, Profile
from fedge.profiles.tier_choice import RunBudget

__all__ = [
    "Budgets",
    "Hardware",
    "Measured",
    "Network",
    "Plan",
    "Profile",
    "RunBudget",
    "builtin_dir",
    "dump_profile",
    "list_profiles",
    "load_profile",
    "parse_profile",
    "plan",
]
