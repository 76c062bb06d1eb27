"""What the robustness tests read from xpm-train's run folders (imported by the test files
beside it: pytest puts their folder on sys.path)."""
import hashlib
import pathlib


def digest(path):
    """SHA-256 of a file, e.g. final_parameters.pt, to compare two runs byte for byte."""
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def steps_written(run_dir):
    """Training steps logged so far in RUN_DIR/metrics.jsonl (0 before the file exists)."""
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"step"' in line) if path.exists() else 0
