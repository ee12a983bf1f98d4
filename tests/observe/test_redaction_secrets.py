"""Credentials in stored text: provider keys, JWTs, Authorization and Bearer credentials, URL passwords and secret
settings are redacted; prose that merely mentions them is not; the finders stay linear on hostile text.

The keys here are made up at run time (random characters after each issuer's prefix), so that no secret scanner takes
this file for a leak."""

from __future__ import annotations

import random
import string
import time

import pytest

from tailguard.observe.redaction import Redactor, find_secrets

pytest.importorskip("presidio_analyzer")

_RNG = random.Random(11)
_ALNUM = string.ascii_letters + string.digits


def _fake(prefix: str, n: int, alphabet: str = _ALNUM) -> str:
    body = "".join(_RNG.choice(alphabet) for _ in range(n - 2))
    return prefix + body + "7q"  # a digit and a letter, whatever the draw


OPENAI = _fake("sk-", 48)
OPENAI_PROJECT = _fake("sk-proj-", 120, _ALNUM + "_-")
ANTHROPIC = _fake("sk-ant-api03-", 93, _ALNUM + "_-")
AWS_KEY_ID = "AKIA" + "".join(_RNG.choice(string.ascii_uppercase + string.digits) for _ in range(16))
AWS_SECRET = _fake("", 40, _ALNUM + "/+")
GITHUB = _fake("ghp_", 36)
GITHUB_FINE = _fake("github_pat_", 82, _ALNUM + "_")
SLACK = "xoxb-" + "".join(_RNG.choice(string.digits) for _ in range(12)) + "-" + _fake("", 24)
HUGGING_FACE = _fake("hf_", 34)
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9." + _fake("eyJ", 60, _ALNUM + "_-") + "."
       + _fake("", 43, _ALNUM + "_-"))
OPAQUE = _fake("", 32)


@pytest.fixture(scope="module")
def redactor():
    return Redactor()


@pytest.mark.parametrize(("text", "expected"), [
    (f"my key is {OPENAI}, keep it", "my key is <API_KEY>, keep it"),
    (f"OPENAI_API_KEY={OPENAI_PROJECT}", "OPENAI_API_KEY=<API_KEY>"),
    (f"client = Anthropic(api_key=\"{ANTHROPIC}\")", "client = Anthropic(api_key=\"<API_KEY>\")"),
    (f"aws_access_key_id = {AWS_KEY_ID}", "aws_access_key_id = <API_KEY>"),
    (f"export AWS_SECRET_ACCESS_KEY={AWS_SECRET}", "export AWS_SECRET_ACCESS_KEY=<SECRET>"),
    (f"git push https://{GITHUB}@github.com/org/repo", "git push https://<API_KEY>@github.com/org/repo"),
    (f"token {GITHUB_FINE}", "token <API_KEY>"),
    (f"slack bot {SLACK}。", "slack bot <API_KEY>。"),
    (f"密钥{HUGGING_FACE}谢谢", "密钥<API_KEY>谢谢"),
    (f"session {JWT} expired", "session <ACCESS_TOKEN> expired"),
    (f"curl -H 'Authorization: Bearer {OPAQUE}' https://api.example.com",
     "curl -H 'Authorization: Bearer <ACCESS_TOKEN>' https://api.example.com"),
    (f'headers = {{"Authorization": "Bearer {JWT}"}}', 'headers = {"Authorization": "Bearer <ACCESS_TOKEN>"}'),
    ("Authorization: Basic dXNlcjpwYXNzd29yZA==", "Authorization: Basic <ACCESS_TOKEN>"),
    (f"send it with Bearer {OPAQUE}.", "send it with Bearer <ACCESS_TOKEN>."),
    ("DATABASE_URL=postgres://admin:s3cr3t@db.example.com:5432/app",
     "DATABASE_URL=postgres://<SECRET>@db.example.com:5432/app"),
    ("https://user:p@ss@host.example.com/x", "https://<SECRET>@host.example.com/x"),  # an unescaped "@"
    ("password: hunter2", "password: <SECRET>"),
    ("DB_PASSWORD=abc123!", "DB_PASSWORD=<SECRET>"),
    ('{"password": "correct horse battery staple", "user": "bob"}', '{"password": "<SECRET>", "user": "bob"}'),
    ("api_key = 'k-1234'", "api_key = '<SECRET>'"),
    ("apiKey: xyz", "apiKey: <SECRET>"),
    ("client_secret: Passw0rd. Then log in.", "client_secret: <SECRET>. Then log in."),
    ("POST /token?client_secret=abc987&grant_type=client_credentials",
     "POST /token?client_secret=<SECRET>&grant_type=client_credentials"),
    ("密码：abc12345，谢谢", "密码：<SECRET>，谢谢"),
    ("我的密码是Passw0rd!", "我的密码是<SECRET>"),
    ("my password is Tr0ub4dor&3", "my password is <SECRET>"),
    ("The password is 123456.", "The password is <SECRET>."),
    ('password is: "correct horse"', 'password is: "<SECRET>"'),
], ids=["openai", "openai-project", "anthropic", "aws-key-id", "aws-secret", "github-in-url", "github-fine-grained",
        "slack", "hugging-face-glued-to-chinese", "jwt", "authorization-bearer", "authorization-in-json",
        "authorization-basic", "bearer", "url-password", "url-password-with-at", "password-yaml", "password-env",
        "password-json", "api-key-python", "api-key-camel-case", "client-secret", "query-parameter", "password-zh",
        "password-zh-is", "password-is", "password-is-digits", "password-is-quoted"])
def test_credentials_are_redacted(redactor, text, expected):
    assert redactor.redact(text) == expected


@pytest.mark.parametrize("text", [
    "Please reset your password.",
    "The password must be at least 8 characters; a passphrase is better.",
    "Password: must be at least 8 characters long",
    "the password is too short; the password is 8-16 characters long; the password was reset-able",
    "the secret to good ramen is the broth",
    "task-management and risk-assessment-frameworks-for-small-teams",
    "sk-learn is not a package; scikit-learn is",
    "the bearer of bad news holds bearer instruments",
    "Authorization: required for all endpoints",
    "max_tokens: 100, eos_token = '</s>', pad_token = tokenizer.eos_token, key: value",
    "password = getpass.getpass()",
    "password = os.environ['DB_PASSWORD']",
    "密码是什么？密码为空。",
    "https://example.com:8443/path?next=/a:b and ftp://files.example.com/x:y",
    "AKIA is a prefix; AKIA123 is too short",
    "eyJ alone, eyJhbGciOiJIUzI1NiJ9 without its other parts",
], ids=["reset-password", "password-must", "password-colon-prose", "password-is-prose", "secret-prose", "sk-in-words", "sk-learn",
        "bearer-prose", "authorization-prose", "tokens-in-code", "getpass", "environ", "password-zh-prose",
        "url-user-only", "akia-short", "jwt-header-only"])
def test_prose_and_code_that_mention_credentials_stay(redactor, text):
    assert redactor.redact(text) == text


def test_a_url_password_is_no_email_and_its_host_stays(redactor):
    text = "mysql://root:hunter2@db.internal.example.com/shop and mail ops@example.com"
    assert redactor.redact(text) == "mysql://<SECRET>@db.internal.example.com/shop and mail <EMAIL_ADDRESS>"


def test_kinds_and_spans():
    text = f"key {OPENAI} jwt {JWT} password={OPAQUE} url ftp://u:pw@h.example.com"
    got = {(kind, text[s:e]) for kind, s, e in find_secrets(text)}
    assert got == {("API_KEY", OPENAI), ("ACCESS_TOKEN", JWT), ("SECRET", OPAQUE), ("SECRET", "u:pw")}


@pytest.mark.parametrize("text", [
    "password:'" * 10_000,
    "password: x " * 8_000,
    "eyJ" * 33_000,
    ("eyJ" + "a" * 20 + ".") * 4_000,
    "a://" * 25_000,
    "a://u:p@b.example.com " * 4_000,
    "sk-" + "-".join(["abcdefghij"] * 9_000),
    "Bearer " * 14_000,
    "Authorization: " * 7_000,
    "?secret=" + "&" * 100_000,
    "password" + " " * 100_000 + ":",
    "密码：" * 30_000,
], ids=["open-quotes", "settings", "jwt-prefixes", "jwt-shapes", "schemes", "url-passwords", "sk-words", "bearers",
        "authorizations", "ampersands", "spaces", "password-zh"])
def test_the_credential_finders_are_linear_on_hostile_text(text):
    # ~5-25 ms each for 100 KB here; a finder that rescanned the text from each candidate would take seconds.
    t0 = time.thread_time()
    list(find_secrets(text))
    assert time.thread_time() - t0 < 1.0


def test_the_mask_without_extras_keeps_a_urls_host_and_hides_its_password():
    from tailguard.observe.redaction import mask_plain

    text = "cannot reach postgresql://bob:s3cretPw@db.example.com/x; card 4111111111111111, mail bob@example.com"
    assert mask_plain(text) == ("cannot reach postgresql://<SECRET>@db.example.com/x; card <CREDIT_CARD>, mail "
                                "<EMAIL_ADDRESS>")
    assert mask_plain("the model `gpt-x` does not exist") == "the model `gpt-x` does not exist"
