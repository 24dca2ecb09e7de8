"""Checkpoint files of a GaLore run, without transformers: what they hold and how they are checked.

- :mod:`.files`: atomic writes, fsync, one error for a full disk, :class:`~.files.GaLoreCheckpointError`;
- :mod:`.state`: ``galore_state.pt``, the exact GaLore state beside a checkpoint's merged model, its
  format and its checks against the checkpoint and the model;
- :mod:`.manifest`: ``galore_manifest.json``, a checksum of every file, written last (it marks the
  checkpoint complete) and verified before a resume loads anything.

The Trainer integration (:mod:`hf_galore_plugin.integrations`) decides when they are written and read.
"""
