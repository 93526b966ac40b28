"""Docs generated from code stay in step with it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from jupyter_ext.configdoc import render

ROOT = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_current() -> None:
    current = (ROOT / "docs" / "configuration.md").read_text()
    assert current == render(), "run: python -m jupyter_ext.configdoc > docs/configuration.md"


NAMED_FILE = re.compile(
    r"(?<![\w.$<{/~-])(?!users/)((?:[\w.-]+/)+[\w-]+\.(?:py|ts|tsx|sh|c|md|yaml|yml|json|toml)|[\w-]+\.py)\b"
)
"""A relative file path (``core/store/stores.py``) or a bare module (``stores.py``); not a
user's part of a store (``users/a_b.c``)."""
NOT_OURS = {"jupyter_server_config.py": "the user's own config file"}


def repository_files() -> list[str]:
    """Every file of the checkout (without dependencies, caches and dot directories)."""
    found = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("node_modules", "lib")]
        found += [Path(top, name).relative_to(ROOT).as_posix() for name in names]
    return found


def test_every_file_the_docs_name_exists() -> None:
    """A file named in backticks in README.md or docs/*.md (``path/like/this.py``, or a
    module's bare name) is one of the repository's, so that a moved or renamed module
    leaves no stale name behind. A path may start anywhere in the tree (``core/...``)."""
    files = repository_files()
    basenames = {f.rsplit("/", 1)[-1] for f in files}
    stale = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            for name in NAMED_FILE.findall(span):
                if "/" in name:
                    known = any(f == name or f.endswith(f"/{name}") for f in files)
                else:
                    known = name in basenames or name in NOT_OURS
                if not known:
                    stale.append(f"{doc.relative_to(ROOT)}: {name}")
    assert stale == []


def test_every_option_says_its_default() -> None:
    from jupyter_ext.settings import options

    for name, trait in options().items():
        assert "Default" in (trait.help or ""), f"{name}: its help must state the default"


def test_every_option_of_the_app_is_documented() -> None:
    """The reference lists SnapshotSettings' options: the app declares none of its own."""
    from jupyter_server.extension.application import ExtensionApp

    from jupyter_ext.app import SnapshotExtensionApp
    from jupyter_ext.settings import options

    ours = set(SnapshotExtensionApp.class_traits(config=True))
    ours -= set(ExtensionApp.class_traits(config=True))
    assert ours == set(options())


def test_options_are_read_under_the_apps_name(tmp_path: Path) -> None:
    """Declared on SnapshotSettings, the options are still configured as
    ``SnapshotExtensionApp.<name>``: in a config file and on the command line (traitlets
    reads the section of every configurable class in the MRO)."""
    from traitlets.config import Config
    from traitlets.config.loader import KVArgParseConfigLoader, PyFileConfigLoader

    from jupyter_ext.app import SnapshotExtensionApp

    (tmp_path / "jupyter_server_config.py").write_text(
        "c.SnapshotExtensionApp.keep_last = 7\nc.SnapshotExtensionApp.store = 's3'\n"
    )
    from_file = PyFileConfigLoader("jupyter_server_config.py", str(tmp_path)).load_config()
    argv = ["--SnapshotExtensionApp.max_store_bytes=123", "--SnapshotExtensionApp.keep_last=9"]
    from_argv = KVArgParseConfigLoader(argv).load_config()
    app = SnapshotExtensionApp(config=from_file)
    assert (app.keep_last, app.store, app.max_store_bytes) == (7, "s3", 0)
    app.update_config(from_argv)  # the command line after the file, as the server does
    assert (app.keep_last, app.store, app.max_store_bytes) == (9, "s3", 123)
    app = SnapshotExtensionApp(config=Config({"SnapshotExtensionApp": {"chunk_kib": 64}}))
    assert app.chunk_kib == 64


def test_z2jh_config_sets_only_real_options() -> None:
    """deploy/z2jh/config.yaml configures the single-user servers through a JSON file the
    chart mounts; a renamed or misspelt option there would only be a warning in each
    user's server log, and the setting silently lost."""
    import yaml
    from jupyter_server.serverapp import ServerApp
    from traitlets.config import Config

    from jupyter_ext.app import SnapshotExtensionApp

    values = yaml.safe_load((ROOT / "deploy" / "z2jh" / "config.yaml").read_text())
    server_config = values["singleuser"]["extraFiles"]["jupyter-server-config"]["data"]
    classes = {cls.__name__: cls for cls in (ServerApp, SnapshotExtensionApp)}
    assert set(server_config) <= set(classes), f"unexpected sections: {set(server_config)}"
    assert server_config["SnapshotExtensionApp"]["store"] == "s3"
    for section, options in server_config.items():
        cls = classes[section]
        unknown = set(options) - set(cls.class_traits(config=True))
        assert not unknown, f"not options of {section}: {unknown}"
        app = cls(config=Config({section: options}))  # a value of the wrong type raises
        assert {name: getattr(app, name) for name in options} == options


def test_z2jh_pods_meet_pod_security_baseline_in_agent_mode() -> None:
    """deploy/z2jh/config.yaml (agent mode): the user pods break no rule of Pod Security
    "baseline" (no capability added, no privilege escalation, RuntimeDefault seccomp, no
    hostPath or host namespaces), and reach the node agent through its CSI volume."""
    from .support.pods import AGENT_CSI_DRIVER, chart_values

    values = chart_values()
    single = values["singleuser"]
    context = values["hub"]["config"]["KubeSpawner"]["extra_container_config"]["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is single["allowPrivilegeEscalation"] is False
    assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert context["privileged"] is False
    volumes = single["storage"]["extraVolumes"]
    assert [v["csi"]["driver"] for v in volumes] == [AGENT_CSI_DRIVER]
    assert not any("hostPath" in v for v in volumes)
    mount = single["storage"]["extraVolumeMounts"][0]["mountPath"]
    assert single["extraEnv"]["JUPYTER_SNAPSHOT_AGENT_SOCKET"] == f"{mount}/agent.sock"


def test_z2jh_pods_run_as_a_user_with_only_the_capabilities_of_the_criu_copy() -> None:
    """The user pods of deploy/z2jh/config.yaml with inpod.yaml (in-pod mode; and the
    image's user): uid 1000, not privileged, every capability dropped but the ones the
    CRIU copy's file capabilities draw on (they must be in the bounding set), and no
    no_new_privs (it would disable them). A change of the file capabilities without the
    pods', or the reverse, fails."""
    from jupyter_ext.core.criu import UNPRIVILEGED_CAPS

    from .support.pods import chart_values

    values = chart_values("inpod.yaml")
    assert "JUPYTER_SNAPSHOT_AGENT_SOCKET" not in values["singleuser"]["extraEnv"]
    container = values["hub"]["config"]["KubeSpawner"]["extra_container_config"]
    context = container["securityContext"]
    assert context["runAsUser"] == values["singleuser"]["uid"] == 1000
    assert context["runAsNonRoot"] is True
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is values["singleuser"]["allowPrivilegeEscalation"]
    assert context["allowPrivilegeEscalation"] is True
    caps = UNPRIVILEGED_CAPS.split("+")[0].split(",")
    assert context["capabilities"] == {
        "drop": ["ALL"],
        "add": sorted(cap.removeprefix("cap_").upper() for cap in caps),
    }
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "\nUSER 1000\n" in dockerfile
    assert UNPRIVILEGED_CAPS in dockerfile
