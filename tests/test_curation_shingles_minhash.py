"""Shingling, shingle hashing and MinHash (bit-for-bit equal to datasketch)."""

import numpy as np
import pytest
from datasketch import LeanMinHash, MinHash
from datasketch_reference import datasketch_minhash, shingle_string_hash, to_lean

from mtnlg_lightning.curation.minhash import MinHasher
from mtnlg_lightning.curation.shingles import (
    ShingleSpec,
    exact_key,
    jaccard_sorted,
    jaccard_strings,
    normalize_chars,
    normalize_words,
    shingle_hashes,
    shingle_set,
    shingle_strings,
)
from mtnlg_lightning.demo.synthetic.near_duplicates import TextGenerator, render

W5 = ShingleSpec("word", 5)


def estimated_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray | float:
    """Fraction of equal signature entries (row-wise for 2-D input)."""
    return (np.asarray(sig_a) == np.asarray(sig_b)).mean(axis=-1)


def test_normalisation_lowercases_and_strips_ascii_punctuation():
    assert normalize_words("Hello, World!  It's  me.\n") == ["hello", "world", "it", "s", "me"]
    assert normalize_chars("  A  b\n\tC ") == "a b c"


def test_shingle_spec_parse():
    assert ShingleSpec.parse("word:5") == W5
    assert ShingleSpec.parse("char:9") == ShingleSpec("char", 9)
    for bad in ("word", "word:0", "token:3", "char:x"):
        with pytest.raises(ValueError):
            ShingleSpec.parse(bad)


def test_word_shingles_windows_and_short_documents():
    text = "a b c d e f g"
    assert shingle_strings(text, W5) == {"a b c d e", "b c d e f", "c d e f g"}
    assert len(shingle_hashes(text, W5)) == 3
    # fewer words than K: one shingle of the whole document; empty: none
    assert shingle_strings("a b", W5) == {"a b"}
    assert len(shingle_hashes("a b", W5)) == 1
    assert shingle_strings("  ... ", W5) == set() and len(shingle_hashes(" ...", W5)) == 0


def test_char_shingles():
    spec = ShingleSpec("char", 3)
    assert shingle_strings("Ab  cd", spec) == {"ab ", "b c", " cd"}
    assert len(shingle_set("Ab  cd", spec)) == 3


def test_hashed_jaccard_equals_string_jaccard():
    gen = TextGenerator(seed=5)
    base = gen.document(1500)
    for spec in (W5, ShingleSpec("word", 3), ShingleSpec("char", 7)):
        a = render(base)
        b = render([p[: len(p) * 3 // 4] for p in base])
        exact = jaccard_strings(shingle_strings(a, spec), shingle_strings(b, spec))
        assert jaccard_sorted(shingle_set(a, spec), shingle_set(b, spec)) == pytest.approx(exact, abs=1e-12)
        assert len(shingle_set(a, spec)) == len(shingle_strings(a, spec))


def test_shingle_string_hash_matches_vectorised_hash():
    text = "The quick brown fox jumps over the lazy dog again"
    strings = [" ".join(normalize_words(text)[i : i + 5]) for i in range(6)]
    assert [shingle_string_hash(s, W5) for s in strings] == shingle_hashes(text, W5).tolist()


def test_exact_key_is_normalisation_invariant():
    k = exact_key(" ".join(normalize_words("Hello,   World!")))
    assert k == exact_key(" ".join(normalize_words("hello world")))
    assert k != exact_key(" ".join(normalize_words("hello worlds")))


@pytest.mark.parametrize("scheme", ["affine32", "legacy"])
def test_minhash_equals_datasketch_update_batch(scheme):
    gen = TextGenerator(seed=1)
    mh = MinHasher(num_perm=260, seed=42, scheme=scheme)
    for _ in range(3):
        h32 = (shingle_hashes(render(gen.document(2000)), W5) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        ours = mh.signature(h32)
        ref = datasketch_minhash(mh, h32)
        assert np.array_equal(ours, ref.hashvalues)
        assert to_lean(mh, ours) == LeanMinHash(ref)


def test_batched_signatures_equal_one_document_at_a_time_and_datasketch():
    """The batched path (documents packed into ~8k-hash products, 32 permutations per block) gives every document
    the signature it gets alone: 260 permutations (a partial last block), an empty document, one longer than a
    batch, and batches that end mid-list."""
    rng = np.random.default_rng(5)
    lengths = [700, 0, 1, 9000, 3, 2500, 8192, 640, 5000, 0, 77]
    docs = [rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32) for n in lengths]
    mh = MinHasher(num_perm=260, seed=42)
    batched = mh.signatures(docs)
    assert batched.shape == (len(docs), 260)
    for doc, sig in zip(docs, batched, strict=True):
        assert np.array_equal(sig, mh.signature(doc))
        assert np.array_equal(sig, datasketch_minhash(mh, doc).hashvalues)


def test_minhash_equals_datasketch_fed_with_shingle_strings():
    """datasketch's own MinHash over the shingle *strings* (hashfunc = our shingle hash) gives our signature."""
    text = render(TextGenerator(seed=2).document(1200))
    words = normalize_words(text)
    strings = [" ".join(words[i : i + 5]).encode() for i in range(len(words) - 4)]
    m = MinHash(
        num_perm=128, seed=7, scheme="affine32", hashfunc=lambda b: shingle_string_hash(b.decode(), W5) & 0xFFFFFFFF
    )
    m.update_batch(strings)
    ours = MinHasher(128, 7).signature((shingle_hashes(text, W5) & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    assert np.array_equal(ours, m.hashvalues)
    # MinHash.bulk (datasketch's batch path) agrees too
    (bulk,) = MinHash.bulk([strings], num_perm=128, seed=7, scheme="affine32", hashfunc=m.hashfunc)
    assert np.array_equal(bulk.hashvalues, ours)


def test_empty_signature_is_datasketch_empty_minhash():
    mh = MinHasher(64, 1)
    assert np.array_equal(mh.signature(np.empty(0, np.uint32)), MinHash(64, 1).hashvalues)


def test_signature_storage_and_estimate():
    gen = TextGenerator(seed=3)
    mh = MinHasher(256, 1)
    base = gen.document(3600)
    a, b = render(base), render([p[:-3] for p in base])
    sa = mh.signature((shingle_hashes(a, W5) & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    sb = mh.signature((shingle_hashes(b, W5) & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    assert sa.dtype == np.uint32 and sa.nbytes == 1024  # <= 1.1 KB/doc
    exact = jaccard_sorted(shingle_set(a, W5), shingle_set(b, W5))
    assert abs(estimated_jaccard(sa, sb) - exact) < 0.1
