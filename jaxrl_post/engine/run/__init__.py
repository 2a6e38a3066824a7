"""The run directory: its lock (`run_lock`), the files a run writes (`run_files`), orbax checkpoints and their
layout (`checkpoint`, `checkpoint_layout`), resume (`run_dir.RunDir`), metric tracking and loggers
(`tracking`, `loggers`: console, jsonl, TensorBoard, W&B).
"""
