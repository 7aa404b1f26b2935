// One Pyodide job in a fresh Node process: load Pyodide, run the code, print `result` as JSON.
// Usage: node bench/pyodide_run.mjs PYODIDE_DIR CODE   (PYODIDE_DIR holds node_modules/pyodide)
import { pathToFileURL } from "node:url";

const [dir, code] = process.argv.slice(2);
const { loadPyodide } = await import(
  pathToFileURL(`${dir}/node_modules/pyodide/pyodide.mjs`).href
);
const pyodide = await loadPyodide();
pyodide.runPython(code);
console.log(JSON.stringify(pyodide.globals.get("result")));
