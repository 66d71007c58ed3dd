"""Plugin packages the tests install (pip install --target): their own tests run in those installs."""

collect_ignore_glob = ["posttrain-*"]
