"""The dual-encoder retrieval example (examples/retrieval.py): InfoNCE over the global batch, recall@k.

One process:   python -m mwloop.main --config=configs/retrieval.py --workdir=runs/retrieval
Two workers:   python -m mwloop.launch --num_workers=2 -- --config=configs/retrieval.py --workdir=DIR
Local negatives, for comparison (trains another model on several replicas): --config.model.negatives=local
"""

import ml_collections

from mwloop import base_config


def get_config(arg: str | None = None):
    del arg
    c = base_config(task="examples.retrieval:DualEncoder")
    c.name = "retrieval"
    c.dataset = ml_collections.ConfigDict({
        "num_documents": 4096, "num_train_pairs": 16384, "num_eval_pairs": 2048, "latent_dim": 8,
        "query_dim": 24, "document_dim": 32, "query_noise": 0.3, "seed": 0, "threads": 0})
    # negatives: "global" (every replica's documents, mwloop.gather_global_batch) or "local" (this replica's).
    c.model = ml_collections.ConfigDict({"hidden": 64, "dim": 32, "temperature": 0.1, "negatives": "global"})
    c.recall_at = (1, 5)
    c.train.global_batch_size = 128  # each query's negatives: the other 127 documents of the global batch
    c.train.steps = 300
    c.train.steps_per_loop = 50
    c.train.log_every_steps = 100
    c.train.eval_every_steps = 150
    c.train.checkpoint_every_steps = 150
    c.eval.global_batch_size = 256  # recall@k among 256 candidates; 2048 eval pairs: 8 whole batches
    c.optimizer.name = "adam"
    c.optimizer.learning_rate = 3e-3
    c.optimizer.schedule = "cosine"
    c.optimizer.weight_decay = 0.0
    return c
