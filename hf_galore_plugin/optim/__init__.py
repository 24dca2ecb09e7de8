"""AdamW with fp32 or 8-bit blockwise state for any tensor (dense, flat partitions, DTensor shards), and
Adafactor (factored second moment) for whole tensors."""

from hf_galore_plugin.optim.adafactor import Adafactor
from hf_galore_plugin.optim.adamw import AdamW
from hf_galore_plugin.optim.functional import adamw_step_8bit, adamw_step_fp32

__all__ = ["Adafactor", "AdamW", "adamw_step_fp32", "adamw_step_8bit"]
