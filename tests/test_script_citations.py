"""Every path under scripts/ that the README, the docs or the code cite names a file that exists,
so a script moved (to scripts/experiments/, say) or deleted cannot leave a stale citation behind."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w/])scripts/[\w/.-]*?\.(?:py|sh)\b")
PLACES = ["README.md", "docs/**/*.md", "wscompress/**/*.py", "tests/*.py", "scripts/**/*.py", "scripts/*.sh",
          "configs/**/*.yaml", "Makefile", ".ci/*"]


def test_citations_are_found():
    text = "run `python scripts/bench_q8.py FOLDER`, scripts/experiments/six_bit_pairs.py; not my_scripts/y.py or scripts/"
    assert CITED.findall(text) == ["scripts/bench_q8.py", "scripts/experiments/six_bit_pairs.py"]


def test_every_cited_script_exists():
    stale = sorted({f"{path.relative_to(REPO)}: {cited}"
                    for pattern in PLACES for path in REPO.glob(pattern) if path.is_file()
                    for cited in CITED.findall(path.read_text(encoding="utf-8")) if not (REPO / cited).is_file()})
    assert stale == [], "stale citations (the script moved or is gone):\n" + "\n".join(stale)
