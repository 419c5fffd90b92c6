"""Announce, then sleep until stopped. No torch."""

import time

from _ready import announce

announce()
time.sleep(600)
