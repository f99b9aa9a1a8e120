"""What a rank computes: the model families (:mod:`~pdserve.models.families`), their layers
(dense, MoE, LoRA, quantized), rotary embeddings, expert placement, and the checkpoint
loader; and where the built-in models come from (:mod:`~pdserve.models.builtin` generates
them, :mod:`~pdserve.models.pycode_train` trains the shipped ``pycode`` ones)."""
