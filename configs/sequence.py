"""A small causal Transformer LM on generated additions ("37+5=42$"): examples/sequence.py.

About 45 s on 2 CPU cores.
"""

import ml_collections

from mwloop import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config(task="examples.sequence:CausalLM")
    c.name = "sequence"
    # Only what CausalLM reads (plus `threads`, which mwloop's input pipelines read).
    c.dataset = ml_collections.ConfigDict({
        "train_size": 16384, "eval_size": 512,  # 4096 overfits by step 2000 (eval exact match 0.61 vs train 0.91)
        "max_digits": 3,  # operands of 1..3 digits: sequences of 6..13 tokens
        "max_len": 16,  # every sequence padded to this: a static number of tokens per example
        "seed": 0,  # the data's own seed: the same sets whatever config.seed is
        "threads": 0,
    })
    c.model = ml_collections.ConfigDict({"d_model": 64, "num_heads": 4, "num_layers": 2, "mlp_ratio": 4})
    c.train.global_batch_size = 64  # divisible by 2 replicas and by 2 workers
    c.train.steps = 3000  # ~45 s on 2 CPU cores
    c.train.steps_per_loop = 100
    c.train.log_every_steps = 300
    c.train.eval_every_steps = 1000
    c.train.checkpoint_every_steps = 1000
    c.eval.global_batch_size = 128
    c.optimizer.name = "adam"
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.schedule = "cosine"
    c.optimizer.weight_decay = 0.0  # the base L2 is for the built-in classification models; unused here
    return c
