"""Sharing checkpoints beyond ptq's own folder.

    card.py        the model card (README.md) written into every checkpoint
    hub.py         push_to_hub: upload a checkpoint to the Hugging Face Hub
    formats.py     which format (compressed-tensors, gptq, awq) holds what; GPTQ/AWQ config and tensors
    gptq.py        the GPTQ layout (qweight, qzeros v1/v2, scales, g_idx): pure functions both ways
    awq.py         the AutoAWQ gemm layout (interleaved nibbles): pure functions both ways
    checkpoint.py  writing GPTQ/AWQ folders; convert: any of the three formats to another
"""
