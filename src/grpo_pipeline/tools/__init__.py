"""The command-line tools around training: the env doctor, compare, episodes, rescore, launch, translate."""
