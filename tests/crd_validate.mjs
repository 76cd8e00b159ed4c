// Validates Prometheus Operator objects against the Operator's CRD schemas, as packaged by
// @kubernetes-models/prometheus-operator (generated from the CRDs' OpenAPI schemas); ./dev setup installs it
// into build/npm.  Reads a JSON list of objects on stdin; prints a JSON list of {kind, name, errors}.
import fs from "fs";
import path from "path";
import { pathToFileURL } from "url";

const pkg = path.join(process.argv[2], "node_modules", "@kubernetes-models", "prometheus-operator");
const v1 = await import(pathToFileURL(path.join(pkg, "monitoring.coreos.com", "v1", "index.js")).href);
const docs = JSON.parse(fs.readFileSync(0, "utf8"));
const out = docs.map((doc) => {
  const Kind = v1[doc.kind];
  if (!Kind) return { kind: doc.kind, name: doc.metadata?.name, errors: [`no schema for kind ${doc.kind}`] };
  try {
    new Kind(doc).validate();
    return { kind: doc.kind, name: doc.metadata?.name, errors: [] };
  } catch (e) {
    return { kind: doc.kind, name: doc.metadata?.name, errors: [String(e.message)] };
  }
});
console.log(JSON.stringify(out));
