#!/usr/bin/env bash
# Installs (or with --delete removes) the CRDs of Kubeflow Trainer v2 and MPI Operator in the
# cluster KUBECONFIG names, for the cluster tier's TrainJob and MPIJob cases: the copies that
# the render tests validate against (crates/deploy/schemas), without their controllers, which
# cannot run without pulling images. The namespaced TrainingRuntime CRD is the
# ClusterTrainingRuntime one with its names and scope changed: upstream generates both from one
# Go type. The PyTorchJob CRD is left out on purpose: the tier checks a launch that needs it.
set -euo pipefail
cd "$(dirname "$0")/../crates/deploy/schemas"
command -v kubectl >/dev/null || { echo "error: kubectl is not on PATH" >&2; exit 1; }
runtime=$(sed -e 's/clustertrainingruntimes\.trainer/trainingruntimes.trainer/' \
  -e 's/kind: ClusterTrainingRuntime$/kind: TrainingRuntime/' \
  -e 's/listKind: ClusterTrainingRuntimeList/listKind: TrainingRuntimeList/' \
  -e 's/plural: clustertrainingruntimes/plural: trainingruntimes/' \
  -e 's/singular: clustertrainingruntime/singular: trainingruntime/' \
  -e 's/^  scope: Cluster$/  scope: Namespaced/' trainer.kubeflow.org_clustertrainingruntimes.yaml)
files=(trainer.kubeflow.org_trainjobs.yaml trainer.kubeflow.org_clustertrainingruntimes.yaml
       kubeflow.org_mpijobs-v2beta1.yaml)
if [ "${1:-}" = --delete ]; then
  for f in "${files[@]}"; do kubectl delete --ignore-not-found -f "$f"; done
  echo "$runtime" | kubectl delete --ignore-not-found -f -
  exit 0
fi
for f in "${files[@]}"; do kubectl apply --server-side -f "$f"; done
echo "$runtime" | kubectl apply --server-side -f -
# Wait until each is served. (`kubectl wait --for condition=established` right after the apply
# fails at once, "<nil> is of the type <nil>", while the API server has not yet written the
# CRD's conditions.)
deadline=$((SECONDS + 60))
for crd in trainjobs.trainer.kubeflow.org trainingruntimes.trainer.kubeflow.org \
           clustertrainingruntimes.trainer.kubeflow.org mpijobs.kubeflow.org; do
  query='{.status.conditions[?(@.type=="Established")].status}'
  until [ "$(kubectl get crd "$crd" -o jsonpath="$query" 2>/dev/null)" = True ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "error: the CRD $crd was not established within 60 s: see kubectl describe crd $crd" >&2
      exit 1
    fi
    sleep 1
  done
done
echo "the CRDs are established"
