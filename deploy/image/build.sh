#!/usr/bin/env bash
# ./dev image: build stepwatch's OCI image with Debian's own tools, then smoke-run it.
#   1. the base: a minimal Debian bookworm root made by mmdebstrap from Debian's packages (no registry),
#      imported as localhost/stepwatch-base:bookworm (kept in build/image/ and reused);
#   2. a wheelhouse: this project's wheel and every wheel its inference and sidecar extras need, with the
#      CPU build of torch (build/image/wheels; the image build then needs no network);
#   3. the image, built by buildah from deploy/image/Containerfile, tagged with the project's version
#      (the tag deploy/k8s names);
#   4. a smoke run with podman: `stepwatch serve` answers /healthz and /metrics, `stepwatch sidecar`
#      answers /metrics (promtool checks both expositions).
# Prints the build time, the image's size and the smoke results; exits non-zero on any failure.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
OUT=$ROOT/build/image
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/pyproject.toml")
IMAGE=localhost/stepwatch:$VERSION
BASE=localhost/stepwatch-base:bookworm
TORCH=torch==2.13.0  # the CPU build (an unpinned torch resolves to a CUDA build of several GB)
say() { printf '\033[1m[image]\033[0m %s\n' "$*" >&2; }

need_tools() {
    local missing=()
    for t in mmdebstrap buildah podman; do command -v "$t" >/dev/null || missing+=("$t"); done
    [ ${#missing[@]} -eq 0 ] && return
    say "installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get install -y "${missing[@]}" >/dev/null 2>&1 || {
        $sudo apt-get update >/dev/null && $sudo apt-get install -y "${missing[@]}" >/dev/null; }
}

base() {
    mkdir -p "$OUT"
    if [ ! -s "$OUT/base.tar" ]; then
        say "making the Debian base with mmdebstrap (python3, venv, ca-certificates; a few minutes)"
        mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            --aptopt='Acquire::Retries "3"' bookworm "$OUT/base.part.tar" >"$OUT/mmdebstrap.log" 2>&1 \
            || { tail -20 "$OUT/mmdebstrap.log" >&2; say "mmdebstrap failed (log: $OUT/mmdebstrap.log)"; exit 1; }
        mv "$OUT/base.part.tar" "$OUT/base.tar"
    fi
    podman image exists "$BASE" || { say "importing the base as $BASE"; podman import -q "$OUT/base.tar" "$BASE" >/dev/null; }
}

wheels() {
    say "collecting the wheelhouse (the project, its inference and sidecar extras, $TORCH)"
    rm -rf "$OUT/wheels"
    "$PY" -m pip wheel -q --wheel-dir "$OUT/wheels" "$TORCH" "$ROOT[inference,sidecar]" >"$OUT/wheels.log" 2>&1 \
        || { tail -20 "$OUT/wheels.log" >&2; say "pip wheel failed (log: $OUT/wheels.log)"; exit 1; }
}

build() {
    say "building $IMAGE with buildah"
    buildah bud --quiet --layers=false --isolation chroot -f "$ROOT/deploy/image/Containerfile" -t "$IMAGE" \
        "$ROOT" >"$OUT/buildah.log" 2>&1 \
        || { tail -30 "$OUT/buildah.log" >&2; say "buildah failed (log: $OUT/buildah.log)"; exit 1; }
}

wait_for() {  # URL, seconds
    local deadline=$((SECONDS + $2))
    until curl -fs -o /dev/null "$1" 2>/dev/null; do
        [ $SECONDS -lt "$deadline" ] || return 1
        sleep 1
    done
}

RUNNER=podman
PIDS=()
CTRS=()

pick_runner() {
    # podman runs containers with crun, which sets the container's rlimits; a VM that refuses that
    # (crun: setrlimit `RLIMIT_NPROC`: Operation not permitted) still runs the image under buildah's chroot
    # isolation: the same image, the same root file system, no OCI runtime.
    local err
    if err=$(podman run --rm --network host "$IMAGE" true 2>&1); then
        return
    fi
    say "podman run failed here: ${err##*Error: }; smoke-running with buildah run --isolation chroot"
    RUNNER=buildah
}

start() {  # NAME, then the command and its arguments
    local name=$1
    shift
    if [ "$RUNNER" = podman ]; then
        podman run -d --rm --network host --name "$name" -v "$OUT/smoke-service.yaml:/etc/stepwatch/service.yaml:ro" \
            "$IMAGE" "$@" >/dev/null
        CTRS+=("$name")
    else
        local ctr
        ctr=$(buildah from -q --name "$name" "$IMAGE")
        CTRS+=("$ctr")
        buildah run --isolation chroot --network host -v "$OUT/smoke-service.yaml:/etc/stepwatch/service.yaml:ro" \
            "$ctr" -- "$@" >"$OUT/$name.log" 2>&1 &
        PIDS+=($!)
    fi
}

stop_all() {
    local p c
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for c in "${CTRS[@]}"; do
        if [ "$RUNNER" = podman ]; then podman rm -f "$c" >/dev/null 2>&1 || true; else buildah rm "$c" >/dev/null 2>&1 || true; fi
    done
}

smoke() {
    local sp wp ok=0
    sp=$("$PY" -c 'from stepwatch.procs import free_port; print(free_port())')
    wp=$("$PY" -c 'from stepwatch.procs import free_port; print(free_port())')
    pick_runner
    # Compile off and no warm-up list: the smoke asks whether the image runs, not how fast it warms up.
    printf 'compile: {enabled: false}\nwarmup: []\n' >"$OUT/smoke-service.yaml"
    say "smoke ($RUNNER): stepwatch serve on :$sp and stepwatch sidecar on :$wp, on the host network"
    trap stop_all EXIT
    start stepwatch-smoke-serve stepwatch serve --config /etc/stepwatch/service.yaml --host 127.0.0.1 --port "$sp"
    start stepwatch-smoke-sidecar stepwatch sidecar --target "http://127.0.0.1:$sp" --host 127.0.0.1 --port "$wp"
    if wait_for "http://127.0.0.1:$sp/healthz" 180; then
        say "serve /healthz: $(curl -fsS "http://127.0.0.1:$sp/healthz")"
    else
        say "serve /healthz: no answer in 180 s"; ok=1
    fi
    check_metrics "serve" "http://127.0.0.1:$sp/metrics" || ok=1
    wait_for "http://127.0.0.1:$wp/metrics" 60 || true
    check_metrics "sidecar" "http://127.0.0.1:$wp/metrics" || ok=1
    return $ok
}

check_metrics() {  # name, URL
    local body
    body=$(curl -fsS "$2") || { say "$1 /metrics: no answer"; return 1; }
    if printf '%s\n' "$body" | promtool check metrics >/dev/null 2>&1; then
        say "$1 /metrics: $(printf '%s\n' "$body" | grep -vc '^#') samples, promtool check metrics clean"
    else
        say "$1 /metrics: promtool check metrics failed"; return 1
    fi
}

t0=$SECONDS
need_tools
base
wheels
build
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
say "built $IMAGE in $((SECONDS - t0)) s; $((size / 1024 / 1024)) MiB"
smoke
say "PASS: $IMAGE builds and runs"
