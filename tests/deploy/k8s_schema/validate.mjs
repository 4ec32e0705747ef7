// Validate Kubernetes manifests (a JSON array on stdin) against the schemas shipped by the
// @kubernetes-models packages, then type-check them with TypeScript so unknown fields fail too
// (the generated ajv validators accept extra properties; `kubectl apply` with strict field
// validation does not). Prints a JSON report: {"ok": bool, "errors": [...], "checked": [...]}.
import { readFileSync, writeFileSync, mkdtempSync, rmSync } from "node:fs";
import { execFileSync } from "node:child_process";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const KINDS = {
  "argoproj.io/v1alpha1/Rollout": ["@kubernetes-models/argo-rollouts/argoproj.io/v1alpha1/Rollout", "Rollout"],
  "argoproj.io/v1alpha1/AnalysisTemplate": ["@kubernetes-models/argo-rollouts/argoproj.io/v1alpha1/AnalysisTemplate", "AnalysisTemplate"],
  "keda.sh/v1alpha1/ScaledObject": ["@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject", "ScaledObject"],
  "v1/Service": ["kubernetes-models/v1/Service", "Service"],
  "apps/v1/Deployment": ["kubernetes-models/apps/v1/Deployment", "Deployment"],
  "networking.k8s.io/v1/Ingress": ["kubernetes-models/networking.k8s.io/v1/Ingress", "Ingress"],
  "autoscaling/v2/HorizontalPodAutoscaler": ["kubernetes-models/autoscaling/v2/HorizontalPodAutoscaler", "HorizontalPodAutoscaler"],
};

const docs = JSON.parse(readFileSync(0, "utf8"));
const errors = [], checked = [], ts = [];
for (const [i, doc] of docs.entries()) {
  const key = `${doc.apiVersion}/${doc.kind}`;
  const entry = KINDS[key];
  if (!entry) { errors.push(`document ${i}: no schema for ${key}`); continue; }
  const mod = await import(entry[0]);
  try { new mod[entry[1]](doc).validate(); checked.push(key); }
  catch (e) { errors.push(`document ${i} (${key} ${doc.metadata?.name}): ${e.message}`); }
  ts.push(`import type { I${entry[1]} as T${i} } from "${entry[0]}";\nexport const d${i}: T${i} = ${JSON.stringify(doc)};`);
}
const dir = mkdtempSync(join(here, ".check-"));
try {
  writeFileSync(join(dir, "manifests.ts"), ts.join("\n") + "\n");
  execFileSync(process.execPath, [join(here, "node_modules/typescript/bin/tsc"), "--noEmit", "--strict",
    "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022", "--skipLibCheck",
    join(dir, "manifests.ts")], { cwd: here, encoding: "utf8" });
} catch (e) {
  for (const line of String(e.stdout || e.message).split("\n").filter(Boolean)) errors.push(`typescript: ${line}`);
} finally { rmSync(dir, { recursive: true, force: true }); }
process.stdout.write(JSON.stringify({ ok: errors.length === 0, errors, checked }) + "\n");
