"""The Hydra config tree (YAML files), installed as batchpage.conf so that an installed wheel can
compose jobs through pkg://batchpage.conf."""
