"""AdamW with fp32 or 8-bit blockwise state for any tensor (dense, flat partitions, DTensor shards)."""

from hf_galore_plugin.optim.adamw import AdamW
from hf_galore_plugin.optim.functional import adamw_step_8bit, adamw_step_fp32

__all__ = ["AdamW", "adamw_step_fp32", "adamw_step_8bit"]
