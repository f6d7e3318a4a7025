"""config.toml parsing: defaults, interpolation, and errors that name the key and the fix."""
from pathlib import Path

import pytest

from engine.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_shipped_config_is_valid_and_complete():
    config = load_config(REPO / "config.toml", env={"FDSERVE_API_KEY": "k"})
    assert config.server.request_timeout == 600
    assert config.flashdecoding.kernel in ("flash", "ffd", "auto")
    text = (REPO / "config.toml").read_text()
    for section, model in config:  # every key is written out in the shipped file
        for key in type(model).model_fields:
            assert f"{key} =" in text or f"# {key} =" in text, f"{section}.{key} missing from config.toml"


def test_unknown_key_names_path_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "[backend]\nkv_cache_ratoi = 0.5\n"))
    assert "backend.kv_cache_ratoi: unknown key; did you mean 'kv_cache_ratio'?" in str(err.value)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="flashdecodng: unknown key; did you mean 'flashdecoding'"):
        load_config(write(tmp_path, "[flashdecodng]\nenable = true\n"))


def test_wrong_type_names_key_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, '[server]\nport = "eighty"\n'))
    assert "server.port" in str(err.value) and "'eighty'" in str(err.value)


@pytest.mark.parametrize("text, key", [
    ("[backend]\nkv_cache_ratio = 0.0\n", "backend.kv_cache_ratio"),
    ("[backend]\nkv_cache_ratio = 1.5\n", "backend.kv_cache_ratio"),
    ("[backend]\nblock_size = 24\n", "backend.block_size"),
    ('[flashdecoding]\nkernel = "fast"\n', "flashdecoding.kernel"),
    ("[backend]\ncuda_graph_max_batch = 0\n", "backend.cuda_graph_max_batch"),
    ("[backend]\ntensor_parallel_size = 0\n", "backend.tensor_parallel_size"),
    ("[distributed]\nmaster_port = 70000\n", "distributed.master_port"),
    ("[distributed]\ntimeout_s = 0\n", "distributed.timeout_s"),
])
def test_impossible_values(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text))


def test_missing_env_var_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, '[api]\napi_key = "${FD_TEST_MISSING_KEY}"\n'), env={})
    assert "api.api_key: environment variable FD_TEST_MISSING_KEY is not set" in str(err.value)


def test_env_interpolation_and_default(tmp_path):
    path = write(tmp_path, '[api]\napi_key = ["${A}", "${B:-fallback}"]\n[server]\nhost = "${H:-127.0.0.1}"\n')
    config = load_config(path, env={"A": "alpha"})
    assert config.api.api_keys == ["alpha", "fallback"]
    assert config.server.host == "127.0.0.1"


def test_overrides_win_over_file(tmp_path):
    config = load_config(write(tmp_path, "[server]\nport = 9000\n"), {"server.port": 9100, "model.dtype": "float32"})
    assert config.server.port == 9100 and config.model.dtype == "float32"


def test_fixed_max_value_accepts_bool_or_number(tmp_path):
    assert load_config(write(tmp_path, "[flashdecoding]\nfixed_max_value = 6.5\n")).flashdecoding.fixed_max_value == 6.5
    config = load_config(write(tmp_path, "[flashdecoding]\nfixed_max_value = true\n"))
    assert config.flashdecoding.fixed_max_value is True


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
