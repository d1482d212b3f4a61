"""Settings that cannot work together are refused in one line before anything starts (issue 31 item 7):
parameter servers with config.deterministic, unknown keys in train.allow_changed, an MLflow URI whose scheme
no store takes, a tracking server that never answers (bounded)."""

from __future__ import annotations

import time

import pytest

import mwloop
from mwloop.config import check
from mwloop.errors import UserError
from tests import silent_server


def test_parameter_servers_with_deterministic_are_refused_by_the_config_check():
    config = mwloop.base_config()
    config.update_from_flattened_dict({"distribution.strategy": "parameter_server", "deterministic": True})
    with pytest.raises(check.ConfigError, match=r"deterministic=True does not work with parameter servers"):
        check.check(config)


def test_parameter_servers_from_tf_config_with_deterministic_are_refused_by_the_run_check():
    config = mwloop.base_config()
    config.deterministic = True  # strategy "auto": the cluster makes it parameter servers
    check.check(config)
    with pytest.raises(check.ConfigError, match=r"deterministic=True"):
        check.check_run(config, num_replicas=1, parameter_server=True)


def test_an_unknown_allow_changed_key_names_the_nearest_valid_one():
    config = mwloop.base_config()
    config.train.allow_changed = "train.steps,optimizer.learnig_rate"
    with pytest.raises(check.ConfigError, match=r"'optimizer\.learnig_rate'.*nearest valid key: "
                                                r"optimizer\.learning_rate"):
        check.check(config)


@pytest.mark.parametrize("keys", ["train.steps", "optimizer", "optimizer.learning_rate, train.steps", ""])
def test_allow_changed_takes_keys_and_sections(keys):
    config = mwloop.base_config()
    config.train.allow_changed = keys
    check.check(config)


@pytest.mark.parametrize("uri", ["htp://127.0.0.1:5000", "sqllite:///x.db", "mlflw://host"])
def test_an_unknown_tracking_uri_scheme_is_an_error(uri):
    from mwloop.artifacts import mlflow_sink  # imports no MLflow itself
    with pytest.raises(UserError, match=r"unknown scheme"):
        mlflow_sink.check_uri(uri)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example", "sqlite:////tmp/m.db",
                                 "file:///tmp/mlruns", "/tmp/mlruns", "postgresql+psycopg2://u@h/db",
                                 "databricks"])
def test_known_tracking_uris_pass(uri):
    from mwloop.artifacts import mlflow_sink
    mlflow_sink.check_uri(uri)


def test_a_server_that_never_answers_costs_the_bound_and_is_named():
    from mwloop.artifacts import mlflow_sink
    port, _ = silent_server.start_in_thread()
    started = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no answer from the MLflow tracking server at "
                                              rf"http://127\.0\.0\.1:{port}/health within 0\.5 s"):
        mlflow_sink.wait_for_health(f"http://127.0.0.1:{port}", timeout_s=0.5)
    assert time.monotonic() - started < 3


def test_no_probe_for_a_local_store():
    from mwloop.artifacts import mlflow_sink
    mlflow_sink.wait_for_health("sqlite:////nonexistent/m.db", timeout_s=0.1)  # returns at once
