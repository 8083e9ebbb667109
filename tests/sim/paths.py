"""Paths shared by the simulator tests."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "templates" / "sim" / "nl2repo.yaml"
