"""Policy factory: ``PolicyOptions``, ``make_policy`` (a policy by name, in ``Guards`` if configured)
and ``policy_profile``.

Why this exists: the configuration names a policy (static, analytic, bandit, hybrid); this maps
the name and one options object to a built policy, so callers (``llm``, the benchmarks, the
tests) need not know each constructor, and the server can find the profile a policy holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from tidespec.errors import ConfigError
from tidespec.speculative.policy.analytic import AnalyticPolicy
from tidespec.speculative.policy.api import SpeculationPolicy, check_gamma_max
from tidespec.speculative.policy.bandit_policies import BanditPolicy, HybridPolicy
from tidespec.speculative.policy.guards import GuardConfig, Guards
from tidespec.speculative.policy.speedup import Profile
from tidespec.speculative.policy.static import StaticPolicy


@dataclass
class PolicyOptions:
    """Everything ``make_policy`` may need; fields a policy does not use are ignored."""

    gamma_max: int = 4
    static_gamma: int | None = None  # static: defaults to gamma_max
    profile: Profile | None = None  # analytic / hybrid (bandit: switching cost)
    seed: int = 0
    ema: float = 0.1
    prior_alpha: float = 0.7
    bucketed: bool = False  # bandit / hybrid: power-of-two buckets instead of exact batch sizes
    guards: GuardConfig | None = None  # None: no guards
    drafters: tuple[str, ...] = ()  # several drafters loaded (a MultiDrafter's members); () = one
    shadowed: frozenset[str] = frozenset()  # of those, the ones scored on the side (model-free)
    stateful: frozenset[str] = frozenset()  # of those, the ones that must catch up after a pause (bandit's cost)
    per_sequence: bool = False  # analytic: each sequence its own drafter (``routing.py``)
    measured_routes: bool = False  # per-sequence: prices scaled by measured route speeds (``routing.RouteMeter``)
    gate: bool = False  # per-sequence: model drafters in or out by measured goodput (``gate.ModelGate``)

    def __post_init__(self) -> None:
        check_gamma_max(self.gamma_max)
        if self.static_gamma is not None and not 0 <= self.static_gamma <= 64:
            raise ValueError(f"static_gamma must be in [0, 64], got {self.static_gamma}")


def _need_profile(opts: PolicyOptions, name: str) -> Profile:
    if opts.profile is None:
        raise ValueError(f"policy {name!r} needs a profile")
    return opts.profile


def _static(o: PolicyOptions) -> SpeculationPolicy:
    return StaticPolicy(o.gamma_max if o.static_gamma is None else o.static_gamma, profile=o.profile)


def _analytic(o: PolicyOptions) -> SpeculationPolicy:
    return AnalyticPolicy(_need_profile(o, "analytic"), o.gamma_max, ema=o.ema, prior_alpha=o.prior_alpha,
                          drafters=_several(o), shadowed=o.shadowed, per_sequence=o.per_sequence,
                          measured_routes=o.measured_routes, gate=o.gate)


def _bandit(o: PolicyOptions) -> SpeculationPolicy:
    cost = o.profile.catchup_cost if o.profile is not None else None
    return BanditPolicy(o.gamma_max, seed=o.seed, switching_cost=cost, bucketed=o.bucketed, profile=o.profile,
                        drafters=_several(o), stateful=o.stateful)


def _hybrid(o: PolicyOptions) -> SpeculationPolicy:
    return HybridPolicy(
        _need_profile(o, "hybrid"), o.gamma_max, seed=o.seed, prior_alpha=o.prior_alpha, ema=o.ema, bucketed=o.bucketed,
        drafters=_several(o), stateful=o.stateful)


def _several(o: PolicyOptions) -> tuple[str, ...]:
    return o.drafters if len(o.drafters) > 1 else ()


MULTI_DRAFTER_POLICIES = ("analytic", "bandit", "hybrid")  # the policies that also choose the drafter

POLICIES: Mapping[str, Callable[[PolicyOptions], SpeculationPolicy]] = MappingProxyType(
    {"static": _static, "analytic": _analytic, "bandit": _bandit, "hybrid": _hybrid}
)


def check_policy_drafters(name: str, drafters: Sequence[str]) -> None:
    """ConfigError unless policy ``name`` can serve ``drafters``: several need a policy that also
    picks the drafter (``MULTI_DRAFTER_POLICIES``). Cheap: commands call it before loading anything."""
    if len(drafters) > 1 and name not in MULTI_DRAFTER_POLICIES:
        raise ConfigError(f"policy {name!r} chooses gamma for one drafter; with several drafters "
                          f"({', '.join(drafters)}) use --policy {' or '.join(MULTI_DRAFTER_POLICIES)}")


def make_policy(name: str, options: PolicyOptions | None = None) -> SpeculationPolicy:
    """Build policy ``name`` (static, analytic, bandit, hybrid), wrapped in Guards if configured."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    opts = options or PolicyOptions()
    check_policy_drafters(name, opts.drafters)
    policy = POLICIES[name](opts)
    return Guards(policy, opts.guards) if opts.guards is not None else policy


def predicted_speedup(policy: SpeculationPolicy | None) -> float | None:
    """The speedup over plain decoding that ``policy`` (or the policy inside ``Guards``) predicted
    for its last plan — analytic and hybrid keep it as ``last_predicted_speedup``; None for policies
    that predict nothing (static, bandit) or no policy. A field read: cheap enough for every step."""
    inner = policy.inner if isinstance(policy, Guards) else policy
    value = getattr(inner, "last_predicted_speedup", None)
    return float(value) if isinstance(value, (int, float)) else None


def policy_profile(policy: SpeculationPolicy) -> Profile | None:
    """The profile a policy (or the policy inside ``Guards``) holds — analytic and hybrid plan with it,
    static and bandit keep it for the metrics; None when it was built without one."""
    inner = policy.inner if isinstance(policy, Guards) else policy
    profile = getattr(inner, "profile", None)
    return profile if isinstance(profile, Profile) else None
