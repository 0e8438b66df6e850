"""Where the repository, the tests' fake assets and the shipped example data are."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
TEST_MODELS = ASSETS / "tiny_models.py"
TOPICS = ROOT / "examples" / "data" / "topics.jsonl"
