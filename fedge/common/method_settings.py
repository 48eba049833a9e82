"""The ``[method]`` settings of every method: one frozen, torch-free descriptor each.

Both halves of a method read the same descriptor — the device half in
:mod:`fedge.edge.methods`, the coordinator half in
:mod:`fedge.coordinator.strategies` — and :mod:`fedge.fleet.registry` names
the descriptor with the two halves, one line per method. Every default here is
the published one unless its documentation says otherwise; ``docs/methods.md``
shows these tables (generated from the declarations below, kept equal by a test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedge.common.generators import FEATURE_LEVEL, GENERATOR_TIERS, IMAGE_LEVEL
from fedge.common.initseeds import SharedStart
from fedge.common.rounds import EXTRACTOR_PREFIX
from fedge.common.settings import MethodSettings, setting
from fedge.errors import ConfigError

# How each method folds an update that trained from an older version in asynchronous mode (MethodSettings.async_rule).
BUFFERED_RULE = ("buffered (FedBuff): a version averages its buffer's updates, each weighted by its samples times its "
                 "staleness weight")
RUNNING_RULE = ("running: every device's latest statistics, each weighted by the staleness weight of its age now "
                "(fedge.coordinator.strategies.running)")


@dataclass(frozen=True)
class LocalSettings(MethodSettings):
    """No federation: no keys."""

    method: ClassVar[str] = "local"
    async_refusal: ClassVar[str | None] = "local shares nothing, so there is no global version to update"


@dataclass(frozen=True)
class FedAvgSettings(MethodSettings):
    """FedAvg within an architecture group: no keys."""

    method: ClassVar[str] = "fedavg"
    async_rule: ClassVar[str] = BUFFERED_RULE

    def shared_start(self) -> SharedStart:
        return SharedStart(group=True)


@dataclass(frozen=True)
class LGFedAvgSettings(MethodSettings):
    """LG-FedAvg: no keys."""

    method: ClassVar[str] = "lgfedavg"
    async_rule: ClassVar[str] = BUFFERED_RULE

    def shared_start(self) -> SharedStart:
        return SharedStart(group=True, fleet=(EXTRACTOR_PREFIX,))


@dataclass(frozen=True)
class PersonalSettings(MethodSettings):
    """Personalisation, a key set every generative and statistics method shares (issue 17).

    FedRoD-style generic and personal predictors (Chen & Chao, ICLR 2022), the personal one
    fitted FedBABU-style (Oh et al., ICLR 2022): at every evaluation a device fine-tunes a copy
    of its federated model (or only its head) on its own real data, keeps it if it does at least
    as well as the federated model on a held-out validation split, and answers its own
    distribution with it; the federated model keeps serving the global task and the federation,
    so neither bytes nor the other devices change.
    """

    personalize: bool = setting(False, "fine-tune a personal copy of the model on the device's real data and "
                                       "use it for its own distribution when it wins on the validation split")
    personal_part: str = setting("model", "what the personal copy fine-tunes: the whole model, or only the head "
                                          "on the federated features", choices=("model", "head"))
    personal_epochs: int = setting(5, "epochs of the personal copy on the device's real data", minimum=1)
    personal_min_steps: int = setting(100, "at least this many SGD steps for the personal copy: a small device "
                                           "runs more than `personal_epochs` epochs to reach them (0 = no floor)",
                                      minimum=0)
    val_fraction: float = setting(0.2, "held-out share of the device's training data that decides between the "
                                       "heads (and, with `guard`, about the synthetic samples); 0 < f < 1")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"[method] val_fraction must lie strictly between 0 and 1, got {self.val_fraction!r}",
                              hint="0 leaves nothing to validate on, 1 nothing to train on: use e.g. 0.2")


@dataclass(frozen=True)
class GuardedSettings(PersonalSettings):
    """Personalisation plus the guard on synthetic knowledge (methods that train on synthetic samples)."""

    guard: bool = setting(False, "each round, keep this round's synthetic samples only if they do not lower "
                                 "accuracy on the held-out split (measured against the same round without "
                                 "them)")
    guard_tolerance: float = setting(0.0, "points of validation accuracy the synthetic samples may cost and "
                                          "still be kept")


@dataclass(frozen=True)
class FedProtoSettings(PersonalSettings):
    """FedProto (Tan et al., AAAI 2022)."""

    method: ClassVar[str] = "fedproto"
    async_rule: ClassVar[str] = RUNNING_RULE
    shares_features: ClassVar[bool] = True
    private_stats: ClassVar[tuple[str, ...]] = ("protos",)

    def statistics_passes(self, local_epochs: int) -> int:
        """One: the prototypes, over the training samples after the epochs."""
        return 1

    lam: float = setting(1.0, "λ, the weight of ‖g(x) − c_y‖² toward the global prototypes", key="lambda")
    inference: str = setting("head", "how a device classifies: its local head, or the nearest global prototype "
                                     "as in the paper", choices=("head", "prototype"))
    head_protos: float = setting(0.0, "w: also train the head on every global prototype, w · CE(h(c_y), y) "
                                      "(fedge; 0 = the paper)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.personalize and self.inference != "head":
            raise ConfigError('[method] personalize needs inference = "head" (a personal head has nothing to '
                              'replace when the nearest prototype classifies)',
                              hint='set inference = "head" or personalize = false')


GEFL_GENERATORS = ("cvae", "dcgan")  # image level (GeFL)
GEFLF_GENERATORS = ("cvae", "dcgan", "ddpm")  # feature level (GeFL-F): DDPM-F too

_TIER_DOC = "generator size for every device (else each device's plan decides)"


@dataclass(frozen=True)
class GenerativeSettings(GuardedSettings):
    """What GeFL and GeFL-F share: the federated generator and the target schedule."""

    generative: ClassVar[bool] = True
    level: ClassVar[str] = IMAGE_LEVEL  # generators of the 1×32×32 inputs (GeFL-F: of the 3×16×16 stem output)
    generators: ClassVar[tuple[str, ...]] = GEFL_GENERATORS

    generator: str = setting("cvae", 'generator kind: `"cvae"` or `"dcgan"` (fedge\'s DDPM is feature-level only)')
    generator_tier: str | None = setting(None, _TIER_DOC, choices=GENERATOR_TIERS, shown="the plan's")
    generator_seed: int = setting(0, "every device builds its generator from this seed, so the first average "
                                     "is over identical starting points (fedge)")
    generator_checkpoint: str | None = setting(None, "start from this saved generator (same kind, shape, tier "
                                                     "and classes; fedge)", shown="none")
    gen_rounds: int = setting(100, "generator rounds (GeFL `gen_wu_epochs`)")
    gen_epochs: int = setting(5, "local generator epochs per round (GeFL `gen_local_ep`)", minimum=1)
    gen_lr: float | None = setting(None, "generator learning rate (> 0)", positive=True,
                                   shown="published (CVAE 1e-3, DCGAN 2e-4)")
    gen_weight_decay: float | None = setting(None, "generator weight decay; set 0 under label skew",
                                             shown="published (CVAE 1e-3, DCGAN 0)")
    gen_batch_size: int | None = setting(None, "generator batch size", minimum=2, shown="`[train] batch_size`")
    synthetic_epochs: int = setting(1, "T_s: epochs on synthetic samples per target round (GeFL `local_ep_gen`)")
    real_epochs: int | None = setting(None, "T_r: epochs on real samples per target round (GeFL `local_ep`)",
                                      minimum=1, shown="`[train] local_epochs`")
    synthetic_ratio: float = setting(1.0, "synthetic samples per real sample (GeFL: one generated batch per "
                                          "real batch)")
    guard_refit: bool = setting(True, "with `guard`: after the verdict, one pass over the held-out fold, so the "
                                      "guard withholds no real sample from training (each gets T_r epochs a "
                                      "round); false: the fold sits out the verdict's epoch")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.generator not in self.generators:
            hint = ("fedge's DDPM is feature-level only (DDPM-F): use method = \"geflf\""
                    if self.generator == "ddpm" else f"use one of {', '.join(self.generators)}")
            raise ConfigError(f"[method] generator must be one of {', '.join(self.generators)}, "
                              f"got {self.generator!r}", hint=hint)

    def real_epochs_or(self, local_epochs: int) -> int:
        """T_r: ``real_epochs`` if set, else the device's ``local_epochs``."""
        return self.real_epochs if self.real_epochs is not None else local_epochs


@dataclass(frozen=True)
class GeFLSettings(GenerativeSettings):
    """GeFL (Kang et al., arXiv 2412.18460): an image-level generator, then the target networks."""

    method: ClassVar[str] = "gefl"
    async_rule: ClassVar[str] = BUFFERED_RULE + " (generators and target networks alike)"

    avg_extractor: bool = setting(True, "average the common extractor over every device in target rounds "
                                        "(LG-FedAvg; GeFL `avg_FE = 1`); false: FedAvg within the group")
    train_generator_in_target: bool | None = setting(None, "keep training the generator in target rounds "
                                                           "(GeFL `freeze_gen`)",
                                                     shown="false for CVAE, true for DCGAN")
    guard_extractor: bool = setting(True, "with `guard` and `avg_extractor`: each target round, keep the fleet's "
                                          "averaged extractor only if it does not lower held-out accuracy "
                                          "against the group's own average (FedAvg within the group); false: "
                                          "always the fleet's")

    def shared_start(self) -> SharedStart:
        # The target networks average within the group; the stem over the fleet with avg_extractor.
        return SharedStart(group=True, fleet=(EXTRACTOR_PREFIX,) if self.avg_extractor else ())

    @property
    def guards_extractor(self) -> bool:
        """The device judges the fleet's extractor against its group's (the coordinator then sends both)."""
        return self.guard and self.avg_extractor and self.guard_extractor

    @property
    def generator_trains_in_target(self) -> bool:
        """``train_generator_in_target``, else the published choice: only the DCGAN keeps training."""
        if self.train_generator_in_target is not None:
            return self.train_generator_in_target
        return self.generator == "dcgan"


@dataclass(frozen=True)
class GeFLFSettings(GenerativeSettings):
    """GeFL-F: LG-FedAvg warm-up, a feature generator on the frozen stem, then the heads."""

    method: ClassVar[str] = "geflf"
    async_rule: ClassVar[str] = BUFFERED_RULE + " (warm-up networks, generators and heads alike)"
    level: ClassVar[str] = FEATURE_LEVEL
    generators: ClassVar[tuple[str, ...]] = GEFLF_GENERATORS

    generator: str = setting("cvae", 'generator kind: `"cvae"`, `"dcgan"` or `"ddpm"` (DDPM-F)')
    warmup_rounds: int = setting(20, "LG-FedAvg warm-up rounds before the generator rounds (GeFL-F)")
    ddpm_steps: int = setting(20, "DDIM sampling steps of the DDPM-F (fedge)", minimum=1)
    ddpm_guidance: float = setting(0.0, "classifier-free guidance weight w of the DDPM-F (0: purely "
                                        "conditional)")

    def shared_start(self) -> SharedStart:
        # The warm-up is LG-FedAvg: the stem over the fleet, the rest within the group.
        return SharedStart(group=True, fleet=(EXTRACTOR_PREFIX,))


@dataclass(frozen=True)
class FedVTCSettings(GuardedSettings):
    """FedVTC (arXiv 2508.01669): statistics up, a local decoder, fine-tuning on decoded images."""

    method: ClassVar[str] = "fedvtc"
    async_rule: ClassVar[str] = RUNNING_RULE
    shares_features: ClassVar[bool] = True
    generative: ClassVar[bool] = True  # the local decoder
    private_stats: ClassVar[tuple[str, ...]] = ("protos", "sigma")

    generator_tier: str | None = setting(None, "decoder size (`vtc` row of the tier table)",
                                         choices=GENERATOR_TIERS, shown="the plan's")
    decoder_lr: float = setting(1e-3, "decoder learning rate (Adam, > 0)", positive=True)
    decoder_epochs: int | None = setting(None, "decoder epochs per round, after the last model epochs "
                                               "(at most `[train] local_epochs`)", minimum=1,
                                         shown="`[train] local_epochs`")
    dm: bool = setting(True, "distribution matching (ablation: false)")
    kl: bool = setting(True, "the KL term toward the global class distribution (ablation: false)")
    finetune: str = setting("full", "what fine-tuning on decoded images trains (`\"head\"`: the ablation)",
                            choices=("full", "head"))
    finetune_epochs: int = setting(1, "fine-tuning epochs per round")
    finetune_real: bool = setting(True, "mix the device's real samples into the fine-tuning epoch")
    synthetic_ratio: float = setting(1.0, "decoded images per real sample in fine-tuning")
    kl_weight: float = setting(1.0, "weight of the KL term")
    dm_weight: float = setting(1.0, "weight of the DM term")
    recon_noise: float = setting(1.0, "s in v = g(x) + s σ_k ⊙ ε during reconstruction (1 as published)")
    synthetic_labels: str = setting("global", "which classes are decoded: every class some device holds "
                                              "(as published) or only the device's own",
                                    choices=("global", "local"))

    def decoder_epochs_or(self, local_epochs: int) -> int:
        """``decoder_epochs`` if set, else every alternation (``local_epochs``)."""
        return self.decoder_epochs if self.decoder_epochs is not None else local_epochs

    def statistics_passes(self, local_epochs: int) -> int:
        """The prototypes and σ, refreshed before each decoder epoch (the decoder's own epochs are not counted)."""
        return self.decoder_epochs_or(local_epochs)

