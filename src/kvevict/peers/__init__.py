"""The peers kvevict is compared with (kvpress, vLLM's CPU build, llama.cpp): where their environments
live (``locations``), how ``kvevict peers setup`` creates them (``environments``), and kvpress's press
table (``kvpress_presses``), read by the child scripts that run in kvpress's own environment."""
