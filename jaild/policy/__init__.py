"""Policies: TOML schema and validation, seccomp profiles, and the pure jail compiler."""

from jaild.policy.schema import Policy, load_policy, load_policy_dir

__all__ = ["Policy", "load_policy", "load_policy_dir"]
