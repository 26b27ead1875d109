package mysql

import (
	"database/sql/driver"
	"fmt"
	"strings"

	"github.com/caddy-iceberg/caddy-iceberg-idempotency/stores/sqlstore"
)

// mergeKind says whether a combined batch may run a statement as part of
// one statement with the others of its kind.
//
// Why: the server parses, resolves and executes every statement of a
// combined batch on its one thread for that connection, one after the
// other, and all the batch's requests wait for it. Merged, the database's
// CPU per fresh keyed request fell from 221–305 to 164–199 µs, and the
// store's throughput rose by about a sixth (see the README's Performance).
//
// Each merged statement takes its row locks in key order (the INSERT's rows
// are in key order, the UPDATE reads a primary-key range), but no longer
// interleaved with the other kind's. Two batches that meet on a key (two
// nodes', or one node's with combined_writes 2 or more) can then
// deadlock; InnoDB detects that at once (innodb_deadlock_detect, on by
// default) and refuses one batch's statement, which rolls that batch back
// like any other refusal. With detection off, the lock wait ends at
// innodb_lock_wait_timeout, which the store sets to its statement timeout,
// and the batch's outcome may be reported unknown.
type mergeKind uint8

const (
	mergeNone mergeKind = iota
	// mergeInsert: Reserve's INSERT of a fresh key (queries.reserveFresh),
	// whose arguments are those of reserveRow. Merged, the rows go as one
	// plain multi-row INSERT: without ON DUPLICATE KEY UPDATE, so that a
	// key that exists makes the server refuse the statement, the batch
	// rolls back and goes again unmerged (see Store.execTogether), where
	// the existing row gets its own answer (0 rows). A multi-row INSERT
	// that succeeds inserted every row.
	mergeInsert
	// mergeFinalize: Finalize's UPDATE (queries.finalize), with arguments
	// those of finalizeCols, then the key and the owner. Merged, they go as one
	// UPDATE whose CASEs give each key its values, followed by a guard
	// that the server refuses unless the UPDATE changed every row (see
	// unmatchedGuard): a record no longer owned rolls the batch back, and
	// it goes again unmerged, where each statement learns its own outcome.
	mergeFinalize
)

// unmatchedGuard fails, with "Result consisted of more than one row"
// (1172), when the statement before it changed other than %d rows: SELECT
// … INTO a variable refuses more than one row, and the two-row table is
// filtered down to none when ROW_COUNT() (the rows the previous statement
// changed) is as expected. A refused statement ends the multi-statement
// query before its COMMIT, as any other.
//
// LIMIT 2 keeps a session's sql_select_limit (which the store sets to
// DEFAULT whatever the DSN says: storeSessionVars) from
// cutting the two rows to one, which would let the guard pass.
const unmatchedGuard = "SELECT 1 INTO @iceberg_idempotency_unmatched FROM (SELECT 1 AS n UNION ALL SELECT 2) AS two WHERE ROW_COUNT() <> %d LIMIT 2"

// inTimeCheck fails as inTime does, once for a batch's merged INSERT.
const inTimeCheck = "SELECT " + inTime + " INTO @iceberg_idempotency_in_time FROM DUAL LIMIT 1"

// batchQuery is the text and arguments of one combined batch, and where
// each statement's outcome is among the server's results.
type batchQuery struct {
	text strings.Builder
	args []driver.NamedValue
	// size bounds the interpolated query's length.
	size int
	// result[i] is the index of statement i's result in the server's
	// list of affected-rows counts (0 is START TRANSACTION's); merged
	// statements share one.
	result []int
	// merged[i] is how many statements the result at index i stands for,
	// for merged ones: each of them changed one row.
	merged map[int]int
	// results counts the server's results: one per statement sent.
	results int
}

// newBatchQuery builds the batch of sts (in key order): merged INSERT
// after its bound's check, merged UPDATE and its guard, then every other
// statement in order. With
// merge false, every statement goes as it would alone.
func newBatchQuery(q queries, sts []sqlstore.Statement[write], merge bool) (*batchQuery, error) {
	bq := &batchQuery{result: make([]int, len(sts)), merged: map[int]int{}, results: 1}
	// Sized once: a busy node builds one of these every few milliseconds,
	// and growing them doubled their garbage.
	text, args := 64, 0
	for _, st := range sts {
		text += len(st.Stmt.sql) + 32
		args += len(st.Args)
		if st.Stmt.merge == mergeFinalize {
			args += len(finalizeCols) + 2 // a merged UPDATE repeats the key in each CASE
		}
	}
	bq.text.Grow(text)
	bq.args = make([]driver.NamedValue, 0, args)
	bq.text.WriteString("START TRANSACTION;\n")
	var merged map[mergeKind][]int
	if merge {
		merged = mergeable(sts)
	}
	if idx := merged[mergeInsert]; len(idx) > 0 {
		// The rows share one bound, the batch's end (see runBatch),
		// checked once before them; a batch run after it stops there.
		// (DO would take the refusal for a warning; LIMIT 1 keeps a
		// session's sql_select_limit 0 from skipping the check.)
		bq.text.WriteString(inTimeCheck + ";\n")
		if err := bq.add(sts[idx[0]].Args[reserveBoundArg]); err != nil {
			return nil, err
		}
		bq.results++
		bq.text.WriteString(q.insertRows)
		for n, i := range idx {
			if n > 0 {
				bq.text.WriteString(",\n")
			}
			bq.text.WriteString(mergedRow)
			args := sts[i].Args
			if err := bq.add(args[:reserveBoundArg]...); err != nil {
				return nil, err
			}
			if err := bq.add(args[reserveBoundArg+1:]...); err != nil {
				return nil, err
			}
		}
		bq.endMerged(idx)
	}
	if idx := merged[mergeFinalize]; len(idx) > 0 {
		bq.text.WriteString(q.finalizeRows)
		for arg, col := range finalizeCols {
			fmt.Fprintf(&bq.text, ",\n%s = CASE `key`", col)
			if err := bq.cases(sts, idx, arg); err != nil {
				return nil, err
			}
		}
		bq.text.WriteString("\nWHERE `key` IN (")
		for n, i := range idx {
			if n > 0 {
				bq.text.WriteString(", ")
			}
			bq.text.WriteString("?")
			if err := bq.add(sts[i].Key); err != nil {
				return nil, err
			}
		}
		bq.text.WriteString(")\nAND owner = CASE `key`")
		if err := bq.cases(sts, idx, finalizeOwnerArg); err != nil {
			return nil, err
		}
		bq.text.WriteString("\nAND " + finalizeLive)
		bq.endMerged(idx)
		fmt.Fprintf(&bq.text, unmatchedGuard+";\n", len(idx))
		bq.results++
	}
	for i, st := range sts {
		if merged[st.Stmt.merge] != nil {
			continue
		}
		bq.text.WriteString(st.Stmt.sql)
		bq.text.WriteString(";\n")
		if err := bq.add(st.Args...); err != nil {
			return nil, err
		}
		bq.result[i] = bq.results
		bq.results++
	}
	bq.text.WriteString("COMMIT")
	bq.results++
	bq.size += bq.text.Len()
	return bq, nil
}

// mergeable returns, by kind, the statements that go merged: those of a
// kind with two or more statements, all on distinct keys. (Two statements
// on one key each need their own outcome: the second of two reservations
// finds the first's row.)
func mergeable(sts []sqlstore.Statement[write]) map[mergeKind][]int {
	byKind := map[mergeKind][]int{}
	for i, st := range sts {
		if st.Stmt.merge != mergeNone {
			byKind[st.Stmt.merge] = append(byKind[st.Stmt.merge], i)
		}
	}
	for kind, idx := range byKind {
		distinct := len(idx) >= 2
		for n := 1; n < len(idx) && distinct; n++ {
			// sts is in key order, so a repeated key is a neighbour.
			distinct = sts[idx[n]].Key != sts[idx[n-1]].Key
		}
		if !distinct {
			delete(byKind, kind)
		}
	}
	return byKind
}

// cases writes one CASE's branches: WHEN key THEN the statement's arg-th
// argument, for the statements idx.
func (bq *batchQuery) cases(sts []sqlstore.Statement[write], idx []int, arg int) error {
	for _, i := range idx {
		bq.text.WriteString(" WHEN ? THEN ?")
		if err := bq.add(sts[i].Key, sts[i].Args[arg]); err != nil {
			return err
		}
	}
	bq.text.WriteString(" END")
	return nil
}

// endMerged ends a merged statement standing for the statements idx.
func (bq *batchQuery) endMerged(idx []int) {
	bq.text.WriteString(";\n")
	for _, i := range idx {
		bq.result[i] = bq.results
	}
	bq.merged[bq.results] = len(idx)
	bq.results++
}

func (bq *batchQuery) add(values ...any) error {
	for _, a := range values {
		v, err := driver.DefaultParameterConverter.ConvertValue(a)
		if err != nil {
			return err
		}
		bq.args = append(bq.args, driver.NamedValue{Ordinal: len(bq.args) + 1, Value: v})
		bq.size += interpolatedSize(v)
	}
	return nil
}

// outcomes maps the server's affected-rows counts of a committed batch to
// its statements. A merged statement that changed other than one row per
// statement it stands for (which its guard or a duplicate key should have
// made the server refuse) leaves each statement's outcome unknown.
func (bq *batchQuery) outcomes(rows []int64) ([]int64, error) {
	if len(rows) != bq.results {
		return nil, fmt.Errorf("mysql: combined statements returned %d results, not %d", len(rows), bq.results)
	}
	for at, n := range bq.merged {
		if rows[at] != int64(n) {
			return nil, fmt.Errorf("mysql: a merged statement of %d rows changed %d", n, rows[at])
		}
	}
	out := make([]int64, len(bq.result))
	for i, at := range bq.result {
		if bq.merged[at] > 0 {
			out[i] = 1
		} else {
			out[i] = rows[at]
		}
	}
	return out, nil
}
