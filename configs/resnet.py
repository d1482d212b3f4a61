"""ResNet configs. `--config=configs/resnet.py[:variant]`:

  digits (default): a small ResNet on scikit-learn's real 8x8 handwritten digits.
  synthetic: ResNet-50 on ImageNet-shaped random data, for speed measurements.
  imagenet: the ResNet-50 v1.5 recipe on ImageNet-layout TFRecords in
    `--config.dataset.data_dir` (make them from image folders with
    `python -m mwloop.data.make_tfrecords`): SGD + Nesterov-free momentum 0.9,
    lr 0.1 x global_batch/256 with 5 warm-up epochs then cosine, L2 1e-4 on
    kernels only, label smoothing 0.1, 90 epochs.
  imagenet_records: the same recipe on records by global index in `--config.dataset.data_dir` (written by
    `python -m mwloop.data.convert`): exact resume at any worker count, elastic jobs (docs/data.md).
"""

from mwloop import base_config


def get_config(arg: str | None = None):
    variant = arg or "digits"
    c = base_config()
    c.name = f"resnet-{variant}"
    if variant == "digits":
        c.model.widths = (16, 32, 64)
        c.model.blocks_per_stage = 1
        c.model.sync_batch_norm = False
        c.train.global_batch_size = 128
        c.train.steps = 600
        c.train.steps_per_loop = 50
        c.train.log_every_steps = 100
        c.train.eval_every_steps = 200
        c.train.checkpoint_every_steps = 200
        c.optimizer.learning_rate = 0.1
        c.optimizer.warmup_steps = 50
    elif variant == "synthetic":
        c.dataset.name = "synthetic"
        c.dataset.image_shape = (224, 224, 3)
        c.dataset.num_classes = 1000
        c.dataset.num_train_examples = 64
        c.dataset.num_eval_examples = 64
        c.model = {"name": "resnet50"}
        c.train.global_batch_size = 32
        c.train.steps = 20
        c.train.steps_per_loop = 10
        c.train.log_every_steps = 10
        c.train.eval_every_steps = 0
        c.train.checkpoint_every_steps = 0
        c.eval.global_batch_size = 32
        c.optimizer.weight_decay = 1e-4
    elif variant in ("imagenet", "imagenet_records"):
        global_batch_size, num_train_examples, epochs = 1024, 1_281_167, 90
        steps_per_epoch = num_train_examples // global_batch_size
        c.dataset.image_size = 224
        c.dataset.label_offset = 1  # the common conversion stores labels 1..1000
        c.dataset.num_classes = 1000
        if variant == "imagenet":
            c.dataset.name = "imagenet"
            c.dataset.num_train_examples = 0  # 0: count the records once at start
            c.dataset.shuffle_buffer = 10_000
            c.dataset.cache = False
        else:
            # DATA_DIR/train and DATA_DIR/validation written by python -m mwloop.data.convert (class folders, or
            # ImageNet-layout TFRecords indexed in place: labels from label_offset): docs/data.md.
            c.dataset.name = "records"
        # sync_batch_norm=True: the same math at any worker count (an elastic job), at three all-reduces per BN layer.
        c.model = {"name": "resnet50", "blocks": (3, 4, 6, 3), "width": 64, "bn_momentum": 0.9,
                   "sync_batch_norm": False}
        c.train.global_batch_size = global_batch_size
        c.train.steps = epochs * steps_per_epoch
        c.train.steps_per_loop = 100
        c.train.log_every_steps = 100
        c.train.eval_every_steps = 4 * steps_per_epoch
        c.train.checkpoint_every_steps = steps_per_epoch
        c.train.label_smoothing = 0.1
        c.eval.global_batch_size = 1000
        c.optimizer.learning_rate = 0.1
        c.optimizer.base_batch_size = 256  # linear scaling: 0.4 at batch 1024
        c.optimizer.warmup_steps = 5 * steps_per_epoch
        c.optimizer.schedule = "cosine"
        c.optimizer.weight_decay = 1e-4
        c.mixed_precision = "mixed_bfloat16"
    else:
        raise ValueError(f"unknown resnet variant {variant!r}; use digits, synthetic, imagenet or imagenet_records")
    return c
