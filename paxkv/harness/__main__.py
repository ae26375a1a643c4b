"""``python -m paxkv.harness <lm-eval arguments>``: lm-eval's command line with "paxkv"
registered (lm-eval finds models only once their module is imported)."""

from paxkv.harness import main

main()
