"""Known bugs of shared tiers on a filesystem (the design brief's §9: vLLM's fs tier, LMCache's disk), each
re-created as the smallest deviation from ``FileTier``. The tests of ``test_fs_tier.py`` must catch every one
(``test_every_faulty_file_tier_is_caught``)."""

from __future__ import annotations

import os

from kvoffload.impl.tiers import FileTier


class ServesUncheckedRecords(FileTier):
    """Loads check nothing but what the read returned (vLLM's fs tier checks the byte count; LMCache checks
    checksums only in its tests): a flipped bit, another key's record, a truncated file are served."""

    def _check(self, header, payload, size, key) -> None:
        pass


class DeletesOnAnyError(FileTier):
    """Any load exception deletes the file, transient or not (vLLM's fs tier), on a directory replicas share."""

    def _read_failed(self, path, error) -> None:
        super()._read_failed(path, error)
        path.unlink(missing_ok=True)


class BudgetPerReplica(FileTier):
    """Each replica keeps its own records within the budget: N replicas on one disk fill N times it (LMCache's disk
    cap overran 14 TB on 4 TB)."""

    def _budgeted(self, pattern: str):
        return self.dir.glob(pattern.split("/", 1)[1])


class RewritesPresentRecords(FileTier):
    """A put replaces whatever is there (temporary file, then ``os.replace``, as vLLM's fs tier publishes): every
    replica that computed a prefix writes it again."""

    def _put(self, key, payload) -> str:
        final = self.path(key)
        final.parent.mkdir(exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        tmp.write_bytes(b"".join(map(bytes, self._seal(key, payload))))
        os.replace(tmp, final)
        self._count("stored")
        return "stored"

    def _seal(self, key, payload):
        from kvoffload.spec.records import seal

        return seal(self.namespace, key, payload)
