"""The suffix drafter's compiled parts (``suffix_expand.c``), built at first use.

:func:`native_expansion` returns a :class:`NativeExpansion` (or ``None`` where it cannot be
built: no C compiler, or ``$HARTS_SUFFIX_NATIVE=0``, logged once). The C source is compiled with
the system compiler (``$CC``, else ``cc``; ``-O2 -shared -fPIC``, no fast-math and no contraction
into fused multiply-adds: probabilities must round as Python's floats do) into
``$HARTS_NATIVE_CACHE`` (default ``~/.cache/megatron_harts``), named by the source's hash, and
loaded through ctypes; no Python headers are needed, so the same path works in an SGLang server's
environment. Building takes ~0.3 s, once per machine; concurrent builders (several servers
starting) each write their own file and rename it in place.

Its functions: the expansion from a node given as its occurrence end positions in a token buffer
(what ``SuffixTrie.expand`` / ``expand_tree`` would return from that node, bitwise: same tokens,
probabilities, parents), a request's whole context draft (``ContextIndex.draft``), and a corpus'
longest match past the trigram (``CorpusIndex._search``); see the C file's comments.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
_SRC = Path(__file__).with_name("suffix_expand.c")
_LOCK = threading.Lock()
_STATE: dict = {}                       # "lib": NativeExpansion | None once tried


class NativeExpansion:
    """ctypes front of ``suffix_expand.c``. Output buffers are reused: results are copied out as
    lists. Not thread-safe (one per process; the drafter is driven by one thread)."""

    def __init__(self, lib: ctypes.CDLL):
        i64, dbl, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
        self._chain = lib.expand_chain
        self._chain.restype = i64
        self._chain.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, dbl, ptr, ptr]
        self._tree = lib.expand_tree
        self._tree.restype = i64
        self._tree.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, dbl, ptr, ptr, ptr]
        self._ctx = lib.context_draft
        self._ctx.restype = i64
        self._ctx.argtypes = [ptr, i64, i64, i64, dbl, dbl, i64, i64, i64, dbl, ptr, ptr, ptr, ptr]
        self._match = lib.corpus_match
        self._match.restype = i64
        self._match.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, i64, ptr, ptr]
        self._masks = lib.tree_masks
        self._masks.restype = i64
        self._masks.argtypes = [ptr, ptr, i64, i64, ptr]
        self._ends_buf = np.empty(0, dtype=np.int64)
        self._m = np.zeros(1, dtype=np.int64)
        self._m_ptr = self._m.ctypes.data
        self._cap = 0
        self._grow(64)

    def _grow(self, n: int) -> None:
        if n <= self._cap:
            return
        self._cap = max(n, 2 * self._cap)
        self._tok = np.empty(self._cap, dtype=np.int64)
        self._prob = np.empty(self._cap, dtype=np.float64)
        self._par = np.empty(self._cap, dtype=np.int64)
        self._ptrs = (self._tok.ctypes.data, self._prob.ctypes.data, self._par.ctypes.data)

    @staticmethod
    def _ends(ends) -> np.ndarray:
        if type(ends) is np.ndarray and ends.dtype == np.int64 and ends.flags.c_contiguous:
            return ends
        return np.asarray(ends, dtype=np.int64)

    def chain(self, arr: int, n_valid: int, sep: int, ends, depth: int, max_depth: int,
              max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """``SuffixTrie.expand`` from the node whose occurrences end at ``ends`` (its count:
        ``len(ends)``) at ``depth``, over the token buffer at address ``arr`` (int64 ``[>= n_valid]``,
        its first ``n_valid`` valid; ``sep`` continues nothing)."""
        e = self._ends(ends)
        self._grow(max_tokens)
        t, p, _ = self._ptrs
        n = self._chain(arr, n_valid, sep, e.ctypes.data, len(e), depth, max_depth, max_tokens,
                        min_prob, t, p)
        if n < 0:
            raise MemoryError("suffix_expand.c: expand_chain ran out of memory")
        return self._tok[:n].tolist(), self._prob[:n].tolist()

    def tree(self, arr: int, n_valid: int, sep: int, ends, depth: int, max_depth: int, max_nodes: int,
             max_len: int, min_prob: float) -> tuple[list[int], list[float], list[int]]:
        """``SuffixTrie.expand_tree`` from the node whose occurrences end at ``ends`` (see
        :meth:`chain`): tokens, cumulative probabilities, parent indices."""
        e = self._ends(ends)
        self._grow(max_nodes)
        t, p, q = self._ptrs
        n = self._tree(arr, n_valid, sep, e.ctypes.data, len(e), depth, max_depth, max_nodes,
                       max_len, min_prob, t, p, q)
        if n < 0:
            raise MemoryError("suffix_expand.c: expand_tree ran out of memory")
        return self._tok[:n].tolist(), self._prob[:n].tolist(), self._par[:n].tolist()

    def context(self, arr: int, n: int, hi: int, min_match: int, factor: float, offset: float, budget: int,
                tree: bool, max_depth: int, min_prob: float):
        """``ContextIndex.draft`` of the context ``arr[:n]`` (address of int64 ``[>= n]``) in one call:
        the longest continued suffix of at most ``hi`` tokens, then the chain or tree from it
        (``SuffixTrie.draft``'s cap and rules). Returns ``(match length, tokens, probabilities,
        parents or None)``; no draft: empty lists (the match length may still be > 0)."""
        self._grow(budget)
        t, p, q = self._ptrs
        k = self._ctx(arr, n, hi, min_match, factor, offset, budget, 1 if tree else 0, max_depth, min_prob,
                      self._m_ptr, t, p, q)
        if k < 0:
            raise MemoryError("suffix_expand.c: context_draft ran out of memory")
        m = int(self._m[0])
        if not k:
            return m, [], [], ([] if tree else None)
        return m, self._tok[:k].tolist(), self._prob[:k].tolist(), (self._par[:k].tolist() if tree else None)

    def corpus_match(self, arr: int, n_valid: int, sep: int, occ: np.ndarray, ctx: int, n_ctx: int, hi: int):
        """``CorpusIndex._search``'s rule from the trigram's occurrences ``occ`` (int64 array,
        ascending) in the buffer at ``arr``, for the context at address ``ctx`` (int64 ``[n_ctx]``):
        ``(m, ends)``, ``ends`` an int64 array of the occurrences matching ``m >= 3`` tokens;
        ``(0, None)`` when no occurrence continues."""
        k = len(occ)
        if len(self._ends_buf) < k:
            self._ends_buf = np.empty(max(k, 2 * len(self._ends_buf)), dtype=np.int64)
        cnt = self._match(arr, n_valid, sep, occ.ctypes.data, k, ctx, n_ctx, hi, self._m_ptr, self._ends_buf.ctypes.data)
        if not cnt:
            return 0, None
        return int(self._m[0]), self._ends_buf[:cnt].copy()

    def tree_masks(self, parents: list[int], counts: list[int], n: int) -> np.ndarray:
        """The verify batch's tree masks, bool ``[len(counts) * n * n]`` (row-major): request ``b``
        has ``counts[b]`` draft nodes after its root, their parents in ``parents`` (flat, in order;
        -1: the root); row ``i`` marks node ``i`` and its ancestors; nodes past the draft are leaves
        under the root. Raises ``ValueError`` on a parent that is not an earlier node."""
        par = np.array(parents, dtype=np.int64)
        cnt = np.array(counts, dtype=np.int64)
        out = np.empty(len(counts) * n * n, dtype=np.bool_)
        if self._masks(par.ctypes.data, cnt.ctypes.data, len(counts), n, out.ctypes.data) < 0:
            raise ValueError("tree_masks: a parent is not an earlier node, or a draft fills the whole tree")
        return out


def build(cache_dir: str | os.PathLike | None = None) -> Path:
    """Compile ``suffix_expand.c`` (if not built yet) and return the shared library's path.
    Raises ``RuntimeError`` with the compiler's message when it fails."""
    src = _SRC.read_bytes()
    cc = os.environ.get("CC", "cc")
    flags = ["-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off", "-std=c99"]
    libs = ["-lm"]
    tag = hashlib.sha256(src + " ".join([cc, *flags, *libs]).encode()).hexdigest()[:16]
    root = Path(cache_dir or os.environ.get("HARTS_NATIVE_CACHE") or Path.home() / ".cache" / "megatron_harts")
    out = root / f"suffix_expand_{tag}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(_SRC), *libs], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{cc} failed on {_SRC}: {(r.stderr or r.stdout).strip()[:500]}")
        os.replace(tmp, out)
    except FileNotFoundError as e:
        raise RuntimeError(f"no C compiler ({cc}): {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def native_expansion() -> NativeExpansion | None:
    """The process's compiled expansion, built and loaded at the first call; ``None`` (logged
    once, the drafter then expands in Python, same drafts) when ``$HARTS_SUFFIX_NATIVE=0`` or the
    build fails."""
    with _LOCK:
        if "lib" in _STATE:
            return _STATE["lib"]
        lib = None
        flag = os.environ.get("HARTS_SUFFIX_NATIVE", "1")
        if flag not in ("0", "1"):
            raise ValueError(f"$HARTS_SUFFIX_NATIVE must be 0 or 1, got {flag!r}")
        if flag == "1":
            try:
                lib = NativeExpansion(ctypes.CDLL(str(build())))
            except (RuntimeError, OSError) as e:
                log.warning("suffix drafter: compiled expansion unavailable, expanding in Python (%s)", e)
        _STATE["lib"] = lib
        return lib
