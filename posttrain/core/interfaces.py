"""Types shared by plugins and the core that are not a plugin kind of their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    """One line of ``rl-cli doctor``: ``ok`` / ``FAIL`` / ``note`` (neither a pass nor a failure), an area
    (``sandbox``, ``gpus``, ...) and a message. Plugins return these from ``posttrain_doctor_checks``."""

    ok: bool
    area: str
    message: str
    note: bool = False

    def line(self) -> str:
        tag = "note" if self.note else ("ok  " if self.ok else "FAIL")
        return f"{tag} {self.area}: {self.message}"

