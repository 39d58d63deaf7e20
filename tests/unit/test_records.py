"""The shared tier's record format (``kvoffload.spec.records``): a record is served only if it is the reader's key's
record, in the reader's namespace, whole and unchanged."""

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.spec.records import Namespace, RecordError, check_record, decode_key, encode_key, header_size, seal

NS = Namespace(model="tiny-llama", weights="sha256:0f3a", kv_dtype="bfloat16", kv_layout="kv_first", block_size=16,
               hash_block_size=16, hash_algorithm="sha256", hash_seed="none-hash:0")
KEY = bytes(range(32))  # a vLLM block hash


def check(header, payload, key=KEY, namespace=NS, size=None):
    """As a reader with its own buffers would: sized from its config, filled from the record."""
    head, body = bytearray(header_size(key)), bytearray(len(payload))
    record = bytes(header) + bytes(payload)
    head[:] = record[:len(head)].ljust(len(head), b"\0")
    body[:] = record[len(head):len(head) + len(body)].ljust(len(body), b"\0")
    check_record(head, body, len(record) if size is None else size, namespace, key)
    return bytes(body)


def test_a_sealed_record_opens_to_its_payload():
    payload = bytes(range(256)) * 4
    assert check(*seal(NS, KEY, payload)) == payload
    assert check(*seal(NS, 7, payload), key=7) == payload  # a later group's key is an int


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(Namespace)])
def test_every_namespace_field_separates_records(field):
    value = getattr(NS, field)
    other = attrs.evolve(NS, **{field: value + 1 if isinstance(value, int) else value + "'"})
    with pytest.raises(RecordError) as refused:
        check(*seal(other, KEY, b"kv" * 8))
    assert refused.value.reason == "namespace"


@pytest.mark.parametrize("change", [dict(weights="updated in place"), dict(config="rope_theta=500000")])
def test_other_weights_or_another_configuration_make_the_record_unreachable(change):
    header, payload = seal(NS, KEY, b"kv" * 8)
    with pytest.raises(RecordError, match="namespace"):
        check(header, payload, namespace=attrs.evolve(NS, **change))


@pytest.mark.parametrize("cut", [1, 20, 43, 44, 50])
def test_a_torn_record_is_short(cut):
    header, payload = seal(NS, KEY, b"kv" * 8)
    record = bytes(header) + bytes(payload)
    with pytest.raises(RecordError) as refused:
        check(record[:cut], b"\0" * 16, size=cut)
    assert refused.value.reason == "short"


def test_a_longer_record_is_refused_whatever_its_header_says():
    header, payload = seal(NS, KEY, b"kv" * 8)
    with pytest.raises(RecordError, match="length"):
        check(header, payload, size=len(header) + len(payload) + 1)
    with pytest.raises(RecordError, match="length"):  # a header claiming more bytes than the reader's config
        check(*seal(NS, KEY, b"kv" * 9)[:1], b"kv" * 8, size=len(header) + 16)


def test_a_record_under_another_keys_name_is_refused():
    with pytest.raises(RecordError, match="key"):
        check(*seal(NS, bytes(32), b"kv" * 8))


@given(st.binary(min_size=1, max_size=64), st.data())
def test_any_flipped_bit_is_caught(payload, data):
    record = bytearray(b"".join(seal(NS, KEY, payload)))
    bit = data.draw(st.integers(0, len(record) * 8 - 1))
    record[bit // 8] ^= 1 << bit % 8
    with pytest.raises(RecordError):
        check(record[:header_size(KEY)], record[header_size(KEY):])


KEYS_IN_A_PROCESS = ("from kvoffload.spec import group_key; "
                     "print([group_key(bytes(range(32)), g) for g in (1, 2)], group_key(12345, 3))")


def test_a_groups_key_is_the_same_in_every_process():
    """Replicas share records by key, so a later group's key must not depend on the process: vLLM's block hashes
    are bytes, and Python salts the hash() of bytes per process (PYTHONHASHSEED)."""
    import subprocess
    import sys

    keys = {subprocess.run([sys.executable, "-c", KEYS_IN_A_PROCESS], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "random")}
    assert len(keys) == 1, keys
    first = keys.pop()
    assert "[" in first and first.count(",") == 1  # two distinct group keys, and one int key


@given(st.one_of(st.binary(max_size=40), st.integers(-(1 << 63), (1 << 63) - 1)))
def test_a_key_decodes_to_itself(key):
    """A store that names records by key (the filesystem tier's index) lists them back to the same keys."""
    assert decode_key(encode_key(key)) == key


@pytest.mark.parametrize("echo", [b"", b"x12", b"i123", bytes.fromhex("ff")])
def test_a_name_that_is_no_key_is_refused(echo):
    with pytest.raises(ValueError):
        decode_key(echo)
