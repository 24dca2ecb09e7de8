"""Configuration of GaLore / Q-GaLore: one dataclass, validated in one place.

Every field has help text (``dataclasses.fields(GaLoreConfig)[i].metadata["help"]``); the
transformers integration turns them into typed ``optim_args`` keys. Contradictory or
out-of-range values raise ``ValueError`` naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

__all__ = [
    "AUTO_RANK",
    "AUTO_SCALE",
    "GaLoreConfig",
    "PRESETS",
    "PROJ_TYPES",
    "BASIS_METHODS",
    "MOMENT_HANDLING",
    "INNER_OPTIMIZERS",
    "REFRESH_SCHEDULES",
    "PAPER_REFRESH",
    "kept_on_resume",
]

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")
BASIS_METHODS = ("svd", "randomized", "sketch")
MOMENT_HANDLING = ("keep", "project", "reset")
REFRESH_SCHEDULES = ("aligned", "staggered")
LOG_KEYS = ("brief", "full")
WEIGHT_STORAGE = ("as_loaded", "int8", "nf4")
BASIS_STORAGE = ("as_computed", "int8", "int4")
STATE_OFFLOAD = ("none", "cpu")
INNER_OPTIMIZERS = ("adamw", "adafactor", "muon")
_OPTIONAL_INTS = (
    "max_proj_gap",
    "weight_group_size",
    "basis_group_size",
    "chunked_loss_tokens",
    "rank_min",
    "rank_max",
)
# Step counts and sizes go into int64 counter buffers (a lazily grown gap is a product of them): any
# value this large is a typo, refused before it overflows somewhere that cannot name the field.
_INT_LIMIT = 2**31
# The layers' random streams are seeded with seed * ~2e12 + counters, which torch.Generator.manual_seed
# takes only below 2**64: seeds up to 2**22 keep every derived seed in range.
_SEED_LIMIT = 2**22
# GaLoreConfig.expert_rank's default (see its help); any other value asks for experts=True.
_EXPERT_RANK = 16
# GaLoreConfig.scale's default: each layer's norm-matched scale (GaLoreConfig.layer_scale).
AUTO_SCALE = "auto"
# GaLoreConfig.rank='auto' and rank_allocation='auto': ranks chosen per layer (hf_galore_plugin.ranks).
AUTO_RANK = "auto"
RANK_ALLOCATIONS = ("uniform", AUTO_RANK)
_DEFAULT_RANK = 128
# The GaLore paper's refresh: every layer records its dense gradient on the same steps and takes the
# exact SVD. The defaults bound a refresh step's memory instead (staggered phases, sketched bases); pass
# it to reproduce the paper or a run made with these settings (GaLoreConfig.preset(name, **PAPER_REFRESH)).
PAPER_REFRESH: dict[str, Any] = {"refresh_schedule": "aligned", "basis_method": "svd"}


def _help(text: str, **kw: Any):
    return field(metadata={"help": text}, **kw)


@dataclass(kw_only=True)
class GaLoreConfig:
    """Settings of one GaLore method. Build with ``GaLoreConfig(...)`` or ``GaLoreConfig.preset(name)``."""

    # Typed int: a config always holds one. 'auto' is a spelling __post_init__ turns into the default rank and
    # rank_allocation='auto' (optim_args reads the field as int or str).
    rank: int = _help(
        "Rank r of the projection basis (GaLore paper: 128 for 60M-350M, 512 for 1B+). 'auto': "
        "rank_allocation='auto' at the default rank 128 (every layer's rank from its gradient, within the budget "
        "of rank 128 for every layer).",
        default=128,
    )
    rank_allocation: str = _help(
        "'uniform' (default): every targeted layer at `rank`. 'auto': each layer's rank chosen from the spectrum "
        "of its calibration gradient, so that the layers' subspaces capture the most gradient energy within "
        "rank_budget (default: the factor values of `rank` in every layer, so memory is what the uniform rank "
        "plans); layers start at `rank` (with a rank_budget: at the one rank whose values fit it) and take their "
        "own at their next refresh after every layer has calibrated. One process only (the factors change shape). "
        "With experts=True each expert stack takes part too: one rank shared by its experts, chosen from the "
        "experts' spectra together (the share of the stack's gradient energy the experts' top-r subspaces "
        "capture), costing num_experts x (its kept side) values per unit of rank; it starts at expert_rank. A "
        "path to a '.json' file: the ranks that file holds, fixed from the start (the galore_ranks.json an 'auto' "
        "run writes (save_rank_report), or {layer name: rank}; an expert stack the file leaves out stays at "
        "expert_rank); every engine runs them.",
        default="uniform",
    )
    rank_budget: Optional[Union[int, str]] = _help(
        "rank_allocation='auto' only: the factor values all targeted layers (expert stacks included) may hold "
        "together, an int, or a size with a unit ('512MiB', '2GB': bytes of factors in the model's dtype). None "
        "(default): the values of `rank` in every linear layer and of expert_rank in every expert stack.",
        default=None,
    )
    rank_min: Optional[int] = _help(
        "rank_allocation='auto' only: the smallest rank a layer or expert stack gets (None: its starting rank // 4, "
        "at least 1: rank // 4 for a linear layer, expert_rank // 4 for a stack).",
        default=None,
    )
    rank_max: Optional[int] = _help(
        "rank_allocation='auto' only: the largest rank a layer or expert stack gets (None: 2 * its starting rank: "
        "2 * rank, or 2 * expert_rank for a stack; at most the layer's (an expert's) projected side minus one). "
        "An explicit rank_min or rank_max bounds every layer and stack alike. The calibration sketch of each "
        "layer (each expert) is this wide.",
        default=None,
    )
    update_proj_gap: int = _help(
        "Optimizer steps between basis refreshes (GaLore paper: 200). With lazy refresh this is the starting gap.",
        default=200,
    )
    scale: Union[float, str] = _help(
        "GaLore scale alpha: the low-rank update is multiplied by it. 'auto' (default): each layer's own "
        "sqrt(projected side / rank) (sqrt(m n) / r for a two-sided basis; 1 where the rank covers the side), "
        "which gives a rank-r update the Frobenius norm of a full-rank Adam update, so the learning rate means "
        "what it means for AdamW: keep your AdamW rate. A float: every layer's scale (the GaLore paper's "
        "pre-training recipe: scale=0.25 with lr 1e-2). Must be 'auto' or > 0.",
        default=AUTO_SCALE,
    )
    proj_type: str = _help(
        "Which side is projected: 'std' (right basis Q when rows >= cols, else left basis P), 'reverse_std' "
        "(the other side), 'left', 'right', or 'full' (two-sided, r x r factor).",
        default="std",
    )
    basis_method: str = _help(
        "How a basis is computed from the layer gradient: 'sketch' (streaming: backward accumulates a "
        "Gaussian sketch of the gradient, (rank + oversampling) x the basis side's dimension, and the basis "
        "is the sketch's top singular subspace; the m x n gradient is never formed), 'svd' (exact, "
        "torch.linalg.svd of the fp32 gradient: the GaLore paper's) or 'randomized' (Halko et al. 2011 range "
        "finder on the fp32 gradient). Default 'sketch': no m x n record and no m x n SVD "
        "(docs/benchmarks/refresh.md 'Refresh cost'), held-out loss within seed noise of 'svd' "
        "(docs/benchmarks/quality-pretraining.md 'Ablations of the defaults').",
        default="sketch",
    )
    oversampling: int = _help(
        "Extra columns of the randomized range finder and of the streaming sketch (Halko et al.: 5-10).", default=8
    )
    power_iterations: int = _help(
        "Subspace (power) iterations of the randomized range finder; 1-2 sharpen a flat spectrum. 'sketch' is "
        "single-pass (Halko et al. 2011, Sec. 5.5) and 'svd' exact: neither uses it.",
        default=1,
    )
    refresh_schedule: str = _help(
        "When layers compute their bases: 'staggered' (each layer has a phase; layers are packed into phases "
        "of at most refresh_budget_mb held bytes (records and the inputs kept for them), a layer calibrates at step == its phase (its factor gets "
        "a zero gradient until then) and refreshes only at steps == its phase modulo update_proj_gap) or "
        "'aligned' (the GaLore paper's: every layer calibrates at step 0 and refreshes every gap at the same "
        "steps, so a refresh step holds every layer's record at once). Default 'staggered': no step holds "
        "more than one phase's records (docs/guides/options.md 'Refresh memory').",
        default="staggered",
    )
    refresh_budget_mb: Optional[float] = _help(
        "refresh_schedule='staggered' only: most MiB a refresh step holds beyond an ordinary step: the refresh "
        "records (fp32 gradients; the sketches with basis_method='sketch') and the inputs the recording layers "
        "keep for them until their backward. Layers are packed into the fewest phases that respect it (a layer "
        "larger than the budget gets a phase to itself; at most update_proj_gap phases). None: the largest "
        "targeted layer's dense fp32 gradient.",
        default=None,
    )
    refresh_tokens: Optional[int] = _help(
        "refresh_schedule='staggered' only: the tokens of one forward on one rank (micro-batch x sequence "
        "length) by which the staggered packing sizes the inputs a recording layer keeps. None: measured at "
        "the model's first training forward (the largest over data-parallel ranks). Set it to make the phases "
        "independent of the first batch and of the number of ranks.",
        default=None,
    )
    lazy_refresh: bool = _help(
        "Q-GaLore's layer-adaptive refresh: when consecutive bases of a layer agree (similarity >= "
        "cos_threshold over lazy_window refreshes) that layer's gap grows by lazy_growth.",
        default=False,
    )
    cos_threshold: float = _help(
        "Subspace similarity (mean squared cosine of principal angles, in [0, 1]) above which two "
        "consecutive bases count as agreeing (Q-GaLore paper: 0.4).",
        default=0.4,
    )
    lazy_window: int = _help("Number of consecutive agreeing refreshes before a gap grows (Q-GaLore: 5).", default=5)
    lazy_growth: int = _help("Factor by which a lazy layer's gap grows (Q-GaLore: 2).", default=2)
    max_proj_gap: Optional[int] = _help(
        "Upper bound of a lazily grown gap (default: 8 x update_proj_gap).", default=None
    )
    moment_handling: str = _help(
        "What happens to the Adam moments of a layer when its basis changes: 'keep' (GaLore paper), "
        "'project' (transport them into the new basis), 'reset' (start the moments from zero).",
        default="keep",
    )
    residual: bool = _help(
        "Fira's residual (arXiv 2410.01623): also train W0 with the part of the gradient outside the subspace, "
        "S = G - G Q Q^T (right basis; G - P P^T G left), scaled per row of the projected gradient's other "
        "dimension by the norm ratio of the factor's Adam update to its gradient, from the previous step, and "
        "held to at most 1.01x the previous step's norm (Fira's growth limiter). Computed in each layer's "
        "backward from x, dy and the basis (one extra weight-sized GEMM per layer and micro-batch, no stored "
        "m x n gradient) and applied to W0 there, at the rate of the previous optimizer step. Needs this "
        "package's AdamW; runs in one process and under DDP (the residual is all-reduced), refused under "
        "FSDP1, FSDP2 and DeepSpeed ZeRO.",
        default=False,
    )
    inner_optimizer: str = _help(
        "The optimizer of the GaLore factors and of every other trainable parameter: 'adamw' (this package's "
        "AdamW, fp32 or 8-bit moments) or 'adafactor' (Adafactor, Shazeer & Stern 2018, as transformers' "
        "galore_adafactor runs it: a factored second moment, m + r values for an m x r factor instead of Adam's "
        "2 m r; update clipping; the step size is the learning rate, relative_step and scale_parameter off). "
        "With 'adafactor', state_bits=8, error_feedback, state_offload='cpu' and residual are refused (AdamW's); "
        "it runs in one process, under DDP and under FSDP2 (row shards: the statistics that sum over rows are "
        "summed over the shards), and is refused under FSDP1 and DeepSpeed ZeRO (1-D flat partitions). 'muon' "
        "(galore_muon: torch.optim.Muon's rule on the factors, momentum orthogonalised by Newton-Schulz, the step "
        "RMS-matched to AdamW's so an AdamW rate carries over; AdamW on every other parameter; one m x r fp32 "
        "momentum per factor, half of Adam's state) has the same limits as 'adafactor' (under FSDP2 each rank "
        "gathers the matrix it orthogonalises and keeps its rows).",
        default="adamw",
    )
    adafactor_beta1: Optional[float] = _help(
        "inner_optimizer='adafactor' only: Adafactor's first-moment coefficient in [0, 1), or None (default, "
        "Adafactor's: no first moment, the state is the factored second moment alone).",
        default=None,
    )
    adafactor_clip_threshold: float = _help(
        "inner_optimizer='adafactor' only: update clipping, the RMS of each update is at most this (Adafactor: 1.0).",
        default=1.0,
    )
    adafactor_decay_rate: float = _help(
        "inner_optimizer='adafactor' only: the second moment's decay beta2_t = 1 - t ** decay_rate at step t "
        "(Adafactor: -0.8; must be < 0).",
        default=-0.8,
    )
    muon_momentum: float = _help(
        "inner_optimizer='muon' only: the momentum coefficient mu in [0, 1) (torch.optim.Muon: 0.95).",
        default=0.95,
    )
    muon_nesterov: bool = _help(
        "inner_optimizer='muon' only: orthogonalise the Nesterov blend (1 - mu) g + mu M instead of the momentum M "
        "(torch.optim.Muon: True).",
        default=True,
    )
    muon_ns_steps: int = _help(
        "inner_optimizer='muon' only: Newton-Schulz iterations of the orthogonalisation, in [1, 100) "
        "(torch.optim.Muon: 5).",
        default=5,
    )
    state_bits: int = _help("Optimizer state precision: 32 (fp32 moments) or 8 (8-bit blockwise).", default=32)
    state_block_size: int = _help("Block size of the 8-bit optimizer state (power of two).", default=256)
    error_feedback: bool = _help(
        "Carry the 8-bit quantization residual of the optimizer state into the next step.", default=False
    )
    state_offload: str = _help(
        "Where the optimizer state lives: 'none' (on the parameters' device) or 'cpu' (host memory, pinned "
        "when CUDA is available, streamed through the device in 16 MiB chunks with double buffering; "
        "bit-identical results).",
        default="none",
    )
    weight_storage: str = _help(
        "Storage of the frozen base weight W0: 'as_loaded' (the model's dtype), 'int8' (group-quantized, "
        "Q-GaLore) or 'nf4' (QLoRA's 4-bit normal float).",
        default="as_loaded",
    )
    weight_group_size: Optional[int] = _help(
        "Quantization group (block) size of W0 (default: 256 for int8, 64 for nf4).", default=None
    )
    basis_storage: str = _help(
        "Storage of the projection basis: 'as_computed' (fp32), 'int8' or 'int4' (Q-GaLore).", default="as_computed"
    )
    basis_group_size: Optional[int] = _help(
        "Quantization group size of the basis (default: 256 for int8, 64 for int4).", default=None
    )
    stochastic_rounding: bool = _help(
        "Round stochastically when the update is folded into a quantized W0 (Q-GaLore), so small updates "
        "are not lost to rounding.",
        default=True,
    )
    target_modules: Optional[Union[list, str]] = _help(
        "Which nn.Linear layers to train with GaLore: None (every nn.Linear except the output head, found by "
        "the model's get_output_embeddings() or named 'lm_head', and layers whose smaller side <= rank), "
        "'all-linear' (every nn.Linear, an untied output head included, as transformers' "
        "optim_target_modules='all-linear' selects; layers whose smaller side <= rank are skipped and named in "
        "the summary line), a list of substrings (a layer whose module name contains one of them, e.g. "
        "['q_proj', 'v_proj']) or any other string: a regex matched with re.fullmatch against the whole module "
        "name (e.g. '.*q_proj'; 'q_proj' alone matches only a top-level module of that name). A list or regex "
        "that selects no trainable layer, or selects a layer whose smaller side <= rank, is an error.",
        default=None,
    )
    exclude_modules: Optional[Union[list, str]] = _help(
        "Layers never trained with GaLore (they keep plain optimizer state), nn.Linear layers and, with "
        "experts=True, experts modules; matched as target_modules matches: a list of substrings (a module whose "
        "name contains one of them, e.g. ['o_proj', 'mlp']) or a string, a regex matched with re.fullmatch "
        "against the whole module name (e.g. '.*o_proj'). A list entry or regex that matches no nn.Linear or "
        "experts module of the model is an error. None (default): nothing beyond target_modules' own rules.",
        default=None,
    )
    experts: bool = _help(
        "Also train the fused expert weights of mixture-of-experts models (transformers' *Experts modules: one "
        "3-D parameter per projection, e.g. gate_up_proj (num_experts x 2*moe_intermediate x hidden)) with "
        "GaLore, one basis and factor per expert at rank expert_rank. False: they stay plain parameters of the "
        "optimizer (dense Adam state). Routers stay dense either way.",
        default=False,
    )
    expert_rank: int = _help(
        "Rank of each expert's basis when experts=True (experts are small matrices, e.g. 768 x 2048 in "
        "Qwen3-30B-A3B, and there are thousands of them: the attention rank would make their factors alone "
        "billions of values). The default 16 (1/48 of a Qwen3-30B-A3B expert's smaller side) is the smallest "
        "of the quality grid's expert ranks within 1% held-out loss of the experts unprojected "
        "(docs/benchmarks/moe.md, 'Quality: mixture of experts').",
        default=_EXPERT_RANK,
    )
    lr_scale: float = _help(
        "Learning rate multiplier of the GaLore groups applied by the integration (0.8-0.9 of the user's).",
        default=0.85,
    )
    lr_recovery_fraction: float = _help(
        "Fraction of training over which the GaLore groups' lr scale recovers linearly to 1.0 (0: never).",
        default=0.0,
    )
    log_keys: str = _help(
        "Which galore/* keys the Trainer's console log lines (progress bar, printer) show: 'brief' (layers "
        "refreshed since the last log line, their mean subspace similarity, seconds spent refreshing) or "
        "'full' (every key). Reporting integrations (TensorBoard, W&B, ...) and state.log_history always get "
        "every key.",
        default="brief",
    )
    seed: int = _help("Seed of the random projections and of stochastic rounding.", default=0)
    chunked_loss: bool = _help(
        "Compute a causal LM's training loss chunk by chunk over tokens (output head and cross-entropy "
        "together, hf_galore_plugin.loss): the N x vocab logits are never formed, saving about three fp32 "
        "copies of them (3 GiB at seq 2048 and a 128k vocabulary); the same loss and gradients. Training "
        "calls (labels given) then return logits=None.",
        default=False,
    )
    chunked_loss_tokens: Optional[int] = _help(
        "chunked_loss only: tokens per chunk (None: as many as keep one chunk's fp32 logits within 128 MiB, "
        "256 at a 128k vocabulary).",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.rank == AUTO_RANK:  # the spelling 'auto' (see the field)
            # rank='auto' spells the allocation at the default rank, whose budget it keeps
            self.rank, self.rank_allocation = _DEFAULT_RANK, AUTO_RANK
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"GaLoreConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if isinstance(self.rank, str):
            raise bad(
                "rank", f"use a positive int (e.g. rank=128) or {AUTO_RANK!r} (each layer's rank from its gradient)"
            )
        for name in (
            "rank",
            "update_proj_gap",
            "lazy_window",
            "state_block_size",
            "lazy_growth",
            "oversampling",
            "power_iterations",
            "state_bits",
            "seed",
            "max_proj_gap",
            "weight_group_size",
            "basis_group_size",
            "chunked_loss_tokens",
            "expert_rank",
            "rank_min",
            "rank_max",
        ):
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INTS:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"GaLoreConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            limit = _SEED_LIMIT if name == "seed" else _INT_LIMIT
            if not -limit < value < limit:
                raise bad(name, f"use a value of magnitude below 2**{limit.bit_length() - 1}")
        # A float field that is not a finite number trains nothing useful: scale=inf turns every merged
        # weight into inf/NaN while the loss may still log as a number.
        for name in ("scale", "cos_threshold", "lr_scale", "lr_recovery_fraction"):
            value = getattr(self, name)
            if name == "scale" and isinstance(value, str):
                if value != AUTO_SCALE:
                    raise bad("scale", f"use {AUTO_SCALE!r} (each layer's norm-matched scale) or a positive float")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"GaLoreConfig.{name} must be a float, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise bad(name, "use a finite number")
        if self.rank < 1:
            raise bad("rank", "use a positive rank, e.g. rank=128")
        self._validate_rank_allocation(bad)
        if self.update_proj_gap < 1:
            raise bad("update_proj_gap", "use a positive number of steps, e.g. update_proj_gap=200")
        if not isinstance(self.scale, str) and not self.scale > 0:
            raise bad("scale", f"use a positive float, e.g. scale=0.25, or scale={AUTO_SCALE!r}")
        for name, allowed in (
            ("proj_type", PROJ_TYPES),
            ("basis_method", BASIS_METHODS),
            ("moment_handling", MOMENT_HANDLING),
            ("weight_storage", WEIGHT_STORAGE),
            ("basis_storage", BASIS_STORAGE),
            ("log_keys", LOG_KEYS),
            ("state_offload", STATE_OFFLOAD),
        ):
            if getattr(self, name) not in allowed:
                raise bad(name, f"choose one of {list(allowed)}")
        if self.refresh_schedule not in REFRESH_SCHEDULES:
            raise bad("refresh_schedule", f"choose one of {list(REFRESH_SCHEDULES)}")
        if self.refresh_budget_mb is not None:
            if isinstance(self.refresh_budget_mb, bool) or not isinstance(self.refresh_budget_mb, (int, float)):
                raise TypeError(
                    f"GaLoreConfig.refresh_budget_mb must be a number of MiB or None, got {self.refresh_budget_mb!r}"
                )
            if not self.refresh_budget_mb > 0:
                raise bad("refresh_budget_mb", "use a positive number of MiB, or None for one layer's gradient")
            if self.refresh_schedule != "staggered":
                raise bad(
                    "refresh_budget_mb", "it bounds the staggered schedule only: set refresh_schedule='staggered'"
                )
        if self.refresh_tokens is not None:
            if isinstance(self.refresh_tokens, bool) or not isinstance(self.refresh_tokens, int):
                raise TypeError(
                    f"GaLoreConfig.refresh_tokens must be an int (tokens of one forward) or None, got "
                    f"{self.refresh_tokens!r}"
                )
            if self.refresh_tokens < 1:
                raise bad("refresh_tokens", "use the tokens of one forward (micro-batch x sequence length), >= 1")
            if self.refresh_schedule != "staggered":
                raise bad("refresh_tokens", "it sizes the staggered schedule only: set refresh_schedule='staggered'")
        if self.oversampling < 0:
            raise bad("oversampling", "use 0 or more extra columns (5-10 is typical)")
        if self.power_iterations < 0:
            raise bad("power_iterations", "use 0 or more power iterations")
        if not 0.0 <= self.cos_threshold <= 1.0:
            raise bad("cos_threshold", "use a similarity in [0, 1] (Q-GaLore: 0.4)")
        if self.lazy_window < 1:
            raise bad("lazy_window", "use at least 1 refresh")
        if self.lazy_growth < 2:
            raise bad("lazy_growth", "use an integer factor >= 2 (Q-GaLore: 2)")
        if self.max_proj_gap is not None and self.max_proj_gap < self.update_proj_gap:
            raise bad("max_proj_gap", f"use a value >= update_proj_gap={self.update_proj_gap}, or None")
        if self.state_bits not in (8, 32):
            raise bad("state_bits", "use 32 (fp32 moments) or 8 (8-bit blockwise moments)")
        for name in ("state_block_size", "weight_group_size", "basis_group_size"):
            value = getattr(self, name)
            if value is not None and (value < 32 or value > 4096 or value & (value - 1)):
                raise bad(name, "use a power of two between 32 and 4096")
        if not isinstance(self.experts, bool):
            raise TypeError(f"GaLoreConfig.experts must be a bool, got {self.experts!r}")
        if not isinstance(self.residual, bool):
            raise TypeError(f"GaLoreConfig.residual must be a bool, got {self.residual!r}")
        if self.residual and self.proj_type == "full":
            # Fira scales the residual along the projected gradient's dimension that no basis cuts.
            raise bad("proj_type", "residual=True scales per row of the side no basis projects: use 'std', "
                      "'reverse_std', 'left' or 'right', or residual=False")  # fmt: skip
        if self.residual and self.experts:
            raise bad(
                "experts", "residual=True is not implemented for expert stacks: set experts=False or residual=False"
            )
        if self.expert_rank < 1:
            raise bad("expert_rank", "use a positive rank, e.g. expert_rank=16")
        # A value other than the default was asked for; without experts=True no expert basis is built at that
        # rank, so the request would pass silently. (The default itself cannot be told apart from no value.)
        if self.expert_rank != _EXPERT_RANK and not self.experts:
            raise bad("expert_rank", "it is the rank of the experts' bases, built with experts=True only: set "
                      "experts=True (optim_args experts=true), or drop expert_rank")  # fmt: skip
        self._validate_inner_optimizer(bad)
        if not isinstance(self.chunked_loss, bool):
            raise TypeError(f"GaLoreConfig.chunked_loss must be a bool, got {self.chunked_loss!r}")
        if self.chunked_loss_tokens is not None:
            if self.chunked_loss_tokens < 1:
                raise bad("chunked_loss_tokens", "use a positive number of tokens per chunk, or None")
            if not self.chunked_loss:
                raise bad("chunked_loss_tokens", "it sizes the chunked loss only: set chunked_loss=True")
        if self.error_feedback and self.state_bits != 8:
            raise bad("error_feedback", "error feedback applies to 8-bit state only: set state_bits=8 or drop it")
        if not 0.0 < self.lr_scale <= 1.0:
            raise bad("lr_scale", "use a multiplier in (0, 1] (0.8-0.9 is typical)")
        if not 0.0 <= self.lr_recovery_fraction <= 1.0:
            raise bad("lr_recovery_fraction", "use a fraction of training in [0, 1]")
        # Both pattern fields follow one rule (inject._matches): a string is a regex of the whole module name,
        # a list holds substrings of it.
        for name in ("target_modules", "exclude_modules"):
            value = getattr(self, name)
            if value is None or (name == "target_modules" and value == "all-linear"):
                continue
            if isinstance(value, str):
                try:
                    re.compile(value)
                except re.error as exc:
                    raise bad(name, f"not a valid regular expression ({exc})") from exc
            elif not isinstance(value, (list, tuple)):
                raise bad(name, "use None, a list of module-name substrings (e.g. ['o_proj']) or a regex string "
                          "matched against the whole module name (e.g. '.*o_proj')"
                          + (", or 'all-linear'" if name == "target_modules" else ""))  # fmt: skip
            elif not all(isinstance(entry, str) for entry in value):
                raise bad(name, "list entries must be strings, substrings of module names, e.g. ['q_proj', 'v_proj']")
            elif "" in value:
                raise bad(name, "an empty entry is a substring of every module name: remove it")
        if isinstance(self.target_modules, (list, tuple)) and not self.target_modules:
            raise bad("target_modules", "an empty list selects nothing; use None for the default targets")

    def _validate_inner_optimizer(self, bad: Any) -> None:
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise bad("inner_optimizer", f"choose one of {list(INNER_OPTIMIZERS)}")
        for name in ("adafactor_clip_threshold", "adafactor_decay_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"GaLoreConfig.{name} must be a finite float, got {value!r}")
        beta1 = self.adafactor_beta1
        if beta1 is not None and (isinstance(beta1, bool) or not isinstance(beta1, (int, float)) or not 0 <= beta1 < 1):
            raise bad("adafactor_beta1", "use None (no first moment) or a float in [0, 1), e.g. 0.9")
        if not self.adafactor_clip_threshold > 0:
            raise bad("adafactor_clip_threshold", "use a positive RMS bound (Adafactor: 1.0)")
        if not self.adafactor_decay_rate < 0:
            raise bad("adafactor_decay_rate", "use a negative exponent (Adafactor: -0.8)")
        momentum = self.muon_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise bad("muon_momentum", "use a float in [0, 1) (torch.optim.Muon: 0.95)")
        if not isinstance(self.muon_nesterov, bool):
            raise bad("muon_nesterov", "use True (torch.optim.Muon's default) or False")
        steps = self.muon_ns_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps < 100:
            raise bad("muon_ns_steps", "use an integer in [1, 100) (torch.optim.Muon: 5)")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        options = {
            "adafactor": ("adafactor_beta1", "adafactor_clip_threshold", "adafactor_decay_rate"),
            "muon": ("muon_momentum", "muon_nesterov", "muon_ns_steps"),
        }
        for owner, names in options.items():
            if self.inner_optimizer == owner:
                continue
            for name in names:
                if getattr(self, name) != defaults[name]:
                    raise bad(name, f"it is an option of {owner.capitalize()}: set inner_optimizer={owner!r} (the "
                              f"galore_{owner} preset), or drop it")  # fmt: skip
        if self.inner_optimizer == "adamw":
            return
        label = self.inner_optimizer.capitalize()
        state = "fp32 statistics" if self.inner_optimizer == "adafactor" else "an fp32 momentum"
        for name, why in (
            ("state_bits", f"{label} keeps {state}: use state_bits=32"),
            ("error_feedback", "it feeds back the 8-bit AdamW state's rounding: drop it"),
            ("residual", "Fira's residual needs each factor's Adam update: use inner_optimizer='adamw'"),
        ):
            if getattr(self, name) != defaults[name]:
                raise bad(name, f"not supported with inner_optimizer={self.inner_optimizer!r} ({why})")
        if self.state_offload != "none":
            size = "m + r values" if self.inner_optimizer == "adafactor" else "one m x r momentum"
            raise bad("state_offload", f"not supported with inner_optimizer={self.inner_optimizer!r} (AdamW's "
                      f"offload; the state of a factor is {size})")  # fmt: skip

    def _validate_rank_allocation(self, bad) -> None:
        fixed = isinstance(self.rank_allocation, str) and self.rank_allocation.endswith(".json")
        if self.rank_allocation not in RANK_ALLOCATIONS and not fixed:
            raise bad(
                "rank_allocation",
                f"choose one of {list(RANK_ALLOCATIONS)}, or the path of a '.json' file of per-layer ranks "
                "(galore_ranks.json of an 'auto' run)",
            )
        options = ("rank_budget", "rank_min", "rank_max")
        if self.rank_allocation != "auto":
            for name in options:
                if getattr(self, name) is not None:
                    raise bad(name, "it is an option of rank_allocation='auto' (rank='auto'): set it, or drop " + name)
            return
        if self.proj_type == "full":
            raise bad("rank_allocation", "'auto' allocates one-sided bases; use proj_type='std' (the default)")
        if self.residual:
            raise bad("rank_allocation", "'auto' is not supported with residual=True; use one of them")
        budget = self.rank_budget
        if budget is not None:
            from .ranks import budget_values  # a leaf module: the size parser lives with the allocator

            try:
                values = budget_values(budget, element_size=1)
            except ValueError as exc:
                raise bad("rank_budget", str(exc)) from None
            if values < 1:
                raise bad("rank_budget", "use a positive number of factor values or a size such as '512MiB'")
        low, high = self.effective_rank_bounds
        if low < 1:
            raise bad("rank_min", "use a positive rank")
        if high < low:
            raise bad("rank_max", f"use a rank at least rank_min ({low})")
        if self.experts:
            low, high = self.rank_bounds(self.expert_rank)
            if high < low:
                raise bad("rank_max" if self.rank_max is not None else "rank_min",
                          f"the expert stacks' bounds [{low}, {high}] (from expert_rank={self.expert_rank}) are "
                          "empty: set rank_max to at least rank_min")  # fmt: skip

    # ------------------------------------------------------------------ derived values
    @property
    def effective_rank_bounds(self) -> tuple[int, int]:
        """rank_allocation='auto': the (min, max) rank of a linear layer before its own side caps it."""
        return self.rank_bounds(self.rank)

    def rank_bounds(self, start: int) -> tuple[int, int]:
        """rank_allocation='auto': the (min, max) rank of a layer that starts at rank `start` (a linear layer:
        ``rank``; an expert stack: ``expert_rank``) before its own side caps it: rank_min and rank_max where set,
        else start // 4 (at least 1) and 2 * start."""
        low = self.rank_min if self.rank_min is not None else max(1, start // 4)
        high = self.rank_max if self.rank_max is not None else 2 * start
        return low, high

    @property
    def effective_max_proj_gap(self) -> int:
        return self.max_proj_gap if self.max_proj_gap is not None else 8 * self.update_proj_gap

    @property
    def effective_weight_group_size(self) -> int:
        if self.weight_group_size is not None:
            return self.weight_group_size
        return 64 if self.weight_storage == "nf4" else 256

    @property
    def effective_basis_group_size(self) -> int:
        if self.basis_group_size is not None:
            return self.basis_group_size
        return 64 if self.basis_storage == "int4" else 256

    def layer_scale(self, projected: Iterable[tuple[int, int]]) -> float:
        """The GaLore scale of a layer whose bases project sides of dimension d to rank r, one (d, r) per
        side with a basis (a side without one, or whose basis is the identity, is left out).

        ``scale='auto'``: Adam's update has entries of size about 1, so a full-rank update of an m x n
        matrix has Frobenius norm about sqrt(m n) and a rank-r one about sqrt(m r) (the basis is
        orthonormal); the scale sqrt(n / r) makes them equal, and one learning rate fits every layer shape
        and rank (APOLLO, arXiv 2412.05270, scales its update by sqrt(n / r) for the same reason). The
        product over sides gives sqrt(m n) / r for a two-sided basis, and 1 with no projected side, where
        the update is exactly Adam's. A float: that float for every layer.
        """
        if not isinstance(self.scale, str):
            return float(self.scale)
        ratio = 1.0
        for dim, rank in projected:
            ratio *= dim / rank
        return math.sqrt(ratio)

    def replace(self, **overrides: Any) -> "GaLoreConfig":
        """A copy with some fields changed (validated)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(
                f"unknown GaLoreConfig field(s) {sorted(unknown)}; valid fields are {sorted(self.field_names())}"
            )
        return dataclasses.replace(self, **overrides)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GaLoreConfig":
        """The configuration of a named product, with optional overrides.

        ``galore_adamw``: fp32 Adam state (GaLore, Zhao et al. 2024).
        ``galore_adamw_8bit``: 8-bit blockwise Adam state.
        ``qgalore_adamw_8bit``: 8-bit state, INT8 W0 with stochastic rounding, INT4 basis, lazy refresh
        (Q-GaLore, Zhang et al. 2024).
        ``galore_adafactor``: Adafactor on the factors and the other parameters (factored second moment:
        ``inner_optimizer='adafactor'``), as transformers' ``galore_adafactor``.
        ``galore_muon``: Muon on the factors (``inner_optimizer='muon'``: torch.optim.Muon's rule, RMS-matched to
        AdamW), AdamW on the other parameters.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def kept_on_resume(changed: dict[str, tuple[Any, Any]], current: GaLoreConfig) -> dict[str, Any]:
    """Of the settings a resume found changed ({field: (saved, now)}), the ones to keep at the saved value.

    Rule: a field whose default changed (a key of PAPER_REFRESH) that the checkpoint holds at its old
    default and this run at its new one was chosen by neither run: it is a version's default, not a
    request, so the resumed run keeps the saved value and continues as it started (a resumed run equals
    an uninterrupted one). A value other than the new default is a request and takes effect as every
    changed schedule setting does; so does the new default together with a refresh_budget_mb or a
    refresh_tokens, which only the staggered schedule has.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(GaLoreConfig)}
    kept = {
        name: changed[name][0]
        for name in PAPER_REFRESH  # in its order, which the log line keeps
        if name in changed and changed[name] == (PAPER_REFRESH[name], defaults[name])
    }
    if current.refresh_budget_mb is not None or current.refresh_tokens is not None:
        kept.pop("refresh_schedule", None)
    return kept


PRESETS: dict[str, dict[str, Any]] = {
    "galore_adamw": {},
    "galore_adamw_8bit": {"state_bits": 8},
    "galore_adafactor": {"inner_optimizer": "adafactor"},
    "galore_muon": {"inner_optimizer": "muon"},
    "qgalore_adamw_8bit": {
        "state_bits": 8,
        "weight_storage": "int8",
        "basis_storage": "int4",
        "stochastic_rounding": True,
        "lazy_refresh": True,
    },
}
