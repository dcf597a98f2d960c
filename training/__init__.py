"""The trainer's parts: the optimizer, monitoring (logs, TensorBoard, MFU), the saved compiled step."""
