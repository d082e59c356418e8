"""headwise.bench.checkout: the bench tools find csrc/ and bench/ in place and installed."""

from headwise.bench.checkout import checkout_root


def _checkout(root):
    (root / "csrc").mkdir(parents=True)
    (root / "bench").mkdir()
    return root


def test_in_place_package_finds_its_own_checkout(tmp_path):
    repo = _checkout(tmp_path / "repo")
    package_file = repo / "python" / "headwise" / "bench" / "checkout.py"
    assert checkout_root(str(package_file), cwd=tmp_path) == repo


def test_installed_package_finds_the_checkout_it_runs_from(tmp_path):
    # In site-packages the package has no csrc/ or bench/ three levels up: the current
    # directory's checkout (or the nearest above it, as from tests/) is the one.
    package_file = tmp_path / "venv" / "lib" / "site-packages" / "headwise" / "bench" / "checkout.py"
    repo = _checkout(tmp_path / "clone")
    assert checkout_root(str(package_file), cwd=repo) == repo
    assert checkout_root(str(package_file), cwd=repo / "tests" / "bench") == repo
    elsewhere = tmp_path / "elsewhere"
    assert checkout_root(str(package_file), cwd=elsewhere) == elsewhere
