"""profile_steps writes a trace that TensorBoard's profile plugin (the `profile` extra) reads with its own loader."""

from __future__ import annotations

import glob
import json
import os

import pytest

from mwloop.run import train
from tests.helpers import load_config

try:  # tensorboard-plugin-profile's own loader (the `profile` and `test` extras); 2.19+ ship it as xprof
    from xprof.convert import raw_to_tool_data
except ImportError:
    from tensorboard_plugin_profile.convert import raw_to_tool_data

pytestmark = pytest.mark.slow  # trains a ResNet (about 10 s)


def test_a_resnet_profile_loads_in_the_profile_plugin(tmp_path):
    workdir = str(tmp_path / "run")
    config = load_config("resnet", **{"distribution.strategy": "default", "train.steps": 6,
                                      "train.steps_per_loop": 1, "train.global_batch_size": 32,
                                      "train.log_every_steps": 2, "train.eval_every_steps": 0,
                                      "train.checkpoint_every_steps": 0, "export": False, "profile_steps": (2, 4)})
    train.train_and_evaluate(config, workdir, mode="train")
    # What `tensorboard --logdir DIR/summaries` shows in its Profile tab: plugins/profile/<run>/<host>.xplane.pb
    [trace] = glob.glob(os.path.join(workdir, "summaries", "plugins", "profile", "*", "*.xplane.pb"))
    tools = raw_to_tool_data.xspace_to_tool_names([trace])
    assert {"trace_viewer@", "overview_page", "framework_op_stats"} <= set(tools), tools
    op_stats, content_type = raw_to_tool_data.xspace_to_tool_data([trace], "framework_op_stats", {})
    assert content_type == "application/json" and op_stats
    text = op_stats.decode() if isinstance(op_stats, bytes) else str(op_stats)
    assert "Conv2D" in text  # the ResNet's convolutions, as the plugin's op table lists them
    trace_events, _ = raw_to_tool_data.xspace_to_tool_data([trace], "trace_viewer", {})  # the JSON timeline
    events = json.loads(trace_events)["traceEvents"]
    assert len(events) > 100  # a timeline of the profiled steps
