"""Redaction with Presidio's pattern recognizers (offline, no NLP model), and ``--store-text`` end to end."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tailguard.observe import redaction
from tailguard.observe.redaction import (
    RedactionUnavailable,
    Redactor,
    card_number_ok,
    cn_id_checksum_ok,
    cn_old_id_ok,
    find_emails,
)
from tests.serving_helpers import ADMIN, fake_server, settle


@pytest.fixture(scope="module")
def redactor():
    pytest.importorskip("presidio_analyzer")
    return Redactor()


@pytest.mark.parametrize("text,expected", [
    ("write to zhang.san@example.com today", "write to <EMAIL_ADDRESS> today"),
    ("邮箱是zhang.san@example.com，谢谢", "邮箱是<EMAIL_ADDRESS>，谢谢"),
    ("我的手机号是13812345678。", "我的手机号是<PHONE_NUMBER>。"),
    ("手机：+86 139-1234-5678", "手机：<PHONE_NUMBER>"),
    ("call +1 (415) 555-0132 now", "call <PHONE_NUMBER> now"),
    ("身份证11010519491231002X号", "身份证<CN_RESIDENT_ID>号"),
    ("server 192.168.1.10 and 2001:db8::1", "server <IP_ADDRESS> and <IP_ADDRESS>"),
    ("IP地址10.0.0.1", "IP地址<IP_ADDRESS>"),
    ("card 4111 1111 1111 1111", "card <CREDIT_CARD>"),
    ("卡号4111111111111111", "卡号<CREDIT_CARD>"),
    ("卡号6212345678901234569已绑定", "卡号<CREDIT_CARD>已绑定"),
    ("卡号 6212-3456-7890-1234-569，谢谢", "卡号 <CREDIT_CARD>，谢谢"),
    ("身份证 110101 19900307 109X", "身份证 <CN_RESIDENT_ID>"),
    ("老身份证110101900307123", "老身份证<CN_RESIDENT_ID>"),
    ("联系：用户@例子.中国谢谢", "联系：<EMAIL_ADDRESS>谢谢"),
    ("write to josé@bücher.de", "write to <EMAIL_ADDRESS>"),
])
def test_redacts(redactor, text, expected):
    assert redactor.redact(text) == expected


@pytest.mark.parametrize("text", [
    "bad checksum id 110105194912310021",  # valid shape, wrong MOD 11-2 check digit
    "not a card 4111111111111112",  # fails Luhn
    "version 1.2.3, port 8080, 42 apples, 2024-01-02",
    "这是一段没有任何个人信息的中文文本。",
])
def test_leaves_harmless_text_alone(redactor, text):
    assert redactor.redact(text) == text


def test_cn_id_checksum():
    assert cn_id_checksum_ok("11010519491231002X")
    assert cn_id_checksum_ok("11010519491231002x")
    assert not cn_id_checksum_ok("110105194912310021")
    assert not cn_id_checksum_ok("11010519491331002X")  # month 13
    assert not cn_id_checksum_ok("1101051949123100")


def test_card_number_checks():
    assert card_number_ok("6212 3456 7890 1234 569")  # 19-digit UnionPay, Luhn-valid
    assert not card_number_ok("6212345678901234560")  # Luhn fails
    assert not card_number_ok("412345678901233")  # Luhn-valid, but Visa issues 13, 16 or 19 digits
    assert not card_number_ok("1709876543210129")  # Luhn-valid microsecond timestamp: no issuer starts with 1
    assert not card_number_ok("6901234567892")  # EAN-13 barcode
    assert not card_number_ok("360102198811220653")  # Luhn-valid, but a valid resident ID (Jiangxi)


def test_cn_id_checks_with_separators_and_the_old_form():
    assert cn_id_checksum_ok("110101 19900307 109X") and cn_id_checksum_ok("110101-19900307-109x")
    assert not cn_id_checksum_ok("11010119900230123X")  # 30 February
    assert cn_old_id_ok("110101900307123") and cn_old_id_ok("110101 900307 123")
    assert not cn_old_id_ok("110101901332123")  # month 13
    assert not cn_old_id_ok("990101900307123")  # no such province
    assert not cn_old_id_ok("118501900307123")  # no such city code


def test_email_host_is_cut_back_to_a_public_suffix():
    suffixes = {"com", "中国"}

    def is_domain(host: str) -> bool:
        return host.rsplit(".", 1)[-1] in suffixes and host.count(".") >= 1

    def spans(text: str) -> list[str]:
        return [text[s:e] for s, e in find_emails(text, is_domain)]

    assert spans("发送至zhang@example.com谢谢") == ["zhang@example.com"]
    assert spans("发到a@b.com.谢谢") == ["a@b.com"]
    assert spans("联系 用户@例子.中国谢谢") == ["用户@例子.中国"]
    assert spans("@app.route and x@y.notatld and a@localhost") == []
    assert spans("x@" + "a." * 50_000 + "com") == []  # over 253 characters: no host, and no quadratic search


def test_redact_none_and_empty(redactor):
    assert redactor.redact(None) is None and redactor.redact("") == ""


def test_store_text_keeps_only_redacted_text(tmp_path, redactor):
    prompt = "我的邮箱是li.si@example.com，手机13812345678"
    with fake_server(tmp_path, redactor=redactor, store_text=True) as s:
        r = httpx.post(s.url + "/v1/chat/completions", headers={"X-Request-ID": "txt-1"},
                       json={"model": "fake", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
                             "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200
        settle(s)
        rec = httpx.get(s.url + "/v1/requests/txt-1", headers=ADMIN).json()
        assert "li.si@example.com" not in rec["prompt_text"] and "13812345678" not in rec["prompt_text"]
        assert "<EMAIL_ADDRESS>" in rec["prompt_text"] and "<PHONE_NUMBER>" in rec["prompt_text"]
        assert rec["output_text"] == "The "
        tok = s.state.engine.tokenizer
        assert rec["prompt_token_ids"] == tok.encode(rec["prompt_text"])  # the tokens of what was kept
        assert len(rec["prompt_token_hmac"]) == 64
        assert len(rec["logprobs"]) == 4
        assert all(e["id"] is not None for e in rec["logprobs"])  # "The " needed no redaction: the full set (T3)
        raw = s.state.store.query("SELECT prompt_text, output_text, prompt_token_ids, record FROM requests")
        assert not any("13812345678" in (v or "") for row in raw for v in row)
    with fake_server(tmp_path / "off") as s:  # default: no text at all
        httpx.post(s.url + "/v1/chat/completions", headers={"X-Request-ID": "txt-2"},
                   json={"model": "fake", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
        settle(s)
        row = s.state.store.query("SELECT prompt_text, output_text, prompt_token_ids FROM requests")[0]
        assert tuple(row) == (None, None, None)
        assert "prompt_text" not in httpx.get(s.url + "/v1/requests/txt-2", headers=ADMIN).json()


def test_store_text_without_presidio_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(redaction, "_REQUIRED", (*redaction._REQUIRED, "tailguard_no_such_module"))
    with pytest.raises(RedactionUnavailable, match=r"pip install 'tailguard\[redaction\]'"):
        redaction.check_available()
    with pytest.raises(RedactionUnavailable, match="tailguard_no_such_module"):
        Redactor()


def test_a_server_imports_no_optional_package():
    """A server-only install (no redaction, bench or report extras) must be able to import the server stack."""
    code = (
        "import sys\n"
        "import tailguard.cli, tailguard.serving.app, tailguard.serving.server, tailguard.observe.store\n"
        "import tailguard.observe.redaction, tailguard.observe.metrics, tailguard.slo.monitor\n"
        "import tailguard.engine.engine\n"
        "tailguard.cli.build_parser()\n"
        "heavy = ('presidio_analyzer', 'presidio_anonymizer', 'spacy', 'plotly', 'rich', 'aiohttp', 'transformers')\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
