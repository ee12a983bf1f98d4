"""The key file (policy/tenants.py) and the keys that guard the API (policy/identity.py): a key file that is missing,
empty, malformed or written by many processes at once must never open the API, echo a secret or lose a key."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import httpx
import pytest
from pydantic import SecretStr

from tailguard.api_error import APIError
from tailguard.policy.identity import Keys
from tailguard.policy.tenants import KeyFile, KeyFileError, Tenants
from tests.serving_helpers import fake_server


def test_a_missing_key_file_is_an_error_unless_it_is_being_created(tmp_path):
    path = tmp_path / "typo-keys.yaml"
    with pytest.raises(KeyFileError, match="no such key file"):
        KeyFile.load(path)
    with pytest.raises(KeyFileError, match="no such key file"):
        Tenants.load(path)  # a server given a mistyped path does not start open
    assert KeyFile.load(path, missing_ok=True).keys == []  # `keys add` creates it
    assert Tenants.load(None) is None  # no key file configured: the only way to "no key file auth"


def test_an_empty_key_table_admits_no_one():
    keys = Keys([], None, Tenants(KeyFile()))
    with pytest.raises(APIError) as err:
        keys.client(None)
    assert err.value.status == 401
    with pytest.raises(APIError):
        keys.client("Bearer tg-anything")
    assert Keys([], None, None).client(None).key_id is None  # no key file and no key at all: open, as documented


def test_a_server_with_a_key_file_without_keys_rejects_requests_without_a_key(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: {acme: {lane: standard}}\nkeys: []\n")
    with fake_server(tmp_path, keys_file=str(path)) as server:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401


def test_a_file_of_other_settings_is_refused_without_echoing_its_values(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("api_key: sk-SUPERSECRET123\nadmin_key: ADMINSECRET\n")
    with pytest.raises(KeyFileError) as err:
        KeyFile.load(path)
    text = str(err.value)
    assert "SUPERSECRET" not in text and "ADMINSECRET" not in text and "api_key" in text
    assert "\n" not in text
    # A mapping key that is not a setting name (a pasted key, a line of another file) is not echoed either.
    path.write_text("sk-PASTEDSECRET: 1\n")
    assert "PASTEDSECRET" not in str(pytest.raises(KeyFileError, KeyFile.load, path).value)


def test_invalid_yaml_is_one_line_without_the_files_text(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("tenants: {a: sk-SECRETVALUE\nkeys: [\n")
    with pytest.raises(KeyFileError) as err:
        KeyFile.load(path)
    assert "not valid YAML at line" in str(err.value)
    assert "SECRETVALUE" not in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("limit", [-1.0, 0.0, float("nan")])
def test_a_limit_that_is_not_positive_is_a_key_file_error(limit):
    for field in ("requests_per_s", "tokens_per_s"):
        with pytest.raises(KeyFileError, match=field) as err:
            KeyFile().add_key("a", **{field: limit})
        assert "\n" not in str(err.value) and "input_value" not in str(err.value)  # one line, as the CLI prints it


def test_a_parent_that_is_a_file_is_a_key_file_error(tmp_path):
    (tmp_path / "existing").write_text("x")
    with pytest.raises(KeyFileError, match="not a directory"), KeyFile.updating(tmp_path / "existing" / "k.yaml"):
        pass


def test_save_uses_a_temporary_file_of_its_own(tmp_path):
    path = tmp_path / "keys.yaml"
    # Another writer's temporary file under the old fixed name is neither used nor removed.
    (tmp_path / "keys.yaml.tmp").write_text("someone else's\n")
    kf = KeyFile()
    kf.add_key("a")
    kf.save(path)
    assert (tmp_path / "keys.yaml.tmp").read_text() == "someone else's\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.yaml", "keys.yaml.tmp"]
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(KeyFile.load(path).keys) == 1


def test_keys_added_at_once_by_many_processes_are_all_kept(tmp_path):
    path = tmp_path / "par.yaml"
    n = 8
    procs = [subprocess.Popen([sys.executable, "-m", "tailguard.cli", "keys", "add", "--file", str(path),
                               "--tenant", f"t{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    keys = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        keys.append(out.strip())
    tenants = Tenants.load(path)
    assert tenants is not None
    for i, key in enumerate(keys):  # every key printed works
        found = tenants.lookup(key)
        assert found is not None and found.name == f"t{i}"
    assert {e.sha256 for e in KeyFile.load(path).keys} == {hashlib.sha256(k.encode()).hexdigest() for k in keys}


def test_keys_with_a_configured_table_still_take_the_client_key():
    keys = Keys([SecretStr("sk-client")], None, Tenants(KeyFile()))
    assert keys.client("Bearer sk-client").key_id is not None
