"""Every variant's pool bytes, after tests/pool_digest.cpp's scenario, against the table recorded at f1d6b61
(tests/pool_digests.txt): a variant in both must give the recorded digest. A variant the table lacks (a
spec added since, a user's) is listed and not compared; one the table has and this build lacks is not
built here (a filtered build). A variant the program could not run fails the check.

Re-recording is never a fix for a difference; the table is the pool of f1d6b61. To record it again (new
default variants only): build tests/pool_digest.cpp against f1d6b61 with this build's specs and append the
lines of the variants the table lacks.

usage: check_pool_digests.py <kvforge_pool_digest binary> <table>"""
import subprocess
import sys


def read_table(lines):
    table = {}
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            name, digest = line.split(maxsplit=1)
            table[name] = digest
    return table


def main(binary, table_path):
    run = subprocess.run([binary], capture_output=True, text=True)
    built = read_table(run.stdout.splitlines())
    with open(table_path) as f:
        recorded = read_table(f)
    failed = [f"{n}: {d}" for n, d in built.items() if d.startswith("error")]
    changed = [f"{n}: {d}, recorded {recorded[n]}" for n, d in built.items()
               if n in recorded and d != recorded[n] and not d.startswith("error")]
    new = sorted(n for n in built if n not in recorded)
    compared = sum(1 for n in built if n in recorded)
    print(f"{compared} variants compared with f1d6b61's pools, {len(changed)} differ, {len(failed)} did not run")
    if new:
        print(f"{len(new)} variants not in the table (added since f1d6b61, not compared): {' '.join(new)}")
    for line in failed + changed:
        print("  " + line)
    if run.returncode != 0 and not failed:
        print(run.stderr)
        failed.append("the program failed")
    if failed or changed:
        return 1
    if compared == 0:
        print("skipped: this build has none of the table's variants")
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
