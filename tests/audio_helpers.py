"""What the audio tests share: the small synthetic keyword set's settings (the ``espeak_kws`` fixture makes it)."""

from __future__ import annotations

from fedge.edge.data.espeak import KeywordSetSettings

# 8 espeak-ng speakers (2 held out for test, 1 for validation), 2 takes of each command and 1 of each auxiliary
# word: 240 clips, a few seconds of espeak-ng
SMALL_KWS = KeywordSetSettings(speakers=8, takes=2, unknown_takes=1, test_speakers=2, val_speakers=1)
