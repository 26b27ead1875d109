package catalog

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/apache/iceberg-go"
	icecat "github.com/apache/iceberg-go/catalog"
	"github.com/apache/iceberg-go/catalog/catalogtest"
	"github.com/apache/iceberg-go/catalog/rest"
	"github.com/apache/iceberg-go/table"
	"github.com/apache/iceberg-go/view"
)

// TestClientTables drives the table operations the conformance suite leaves
// out (commit, staged create, rename, register, transactions) through
// iceberg-go's REST client, so statuses and bodies match what it expects.
func TestClientTables(t *testing.T) {
	ctx := context.Background()
	_, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)

	// iceberg-go's SQL catalog does not treat a parent level as existing on
	// its own, so both levels are created.
	ns := table.Identifier{"outer", "inner"}
	for _, n := range []table.Identifier{{"outer"}, ns} {
		if err := cat.CreateNamespace(ctx, n, nil); err != nil {
			t.Fatalf("CreateNamespace(%v): %v", n, err)
		}
	}
	children, err := cat.ListNamespaces(ctx, table.Identifier{"outer"})
	if err != nil || len(children) != 1 || !slices.Equal(children[0], ns) {
		t.Fatalf("ListNamespaces(outer) = %v, %v", children, err)
	}

	ident := table.Identifier{"outer", "inner", "events"}
	tbl, err := cat.CreateTable(ctx, ident, catalogtest.Schema)
	if err != nil {
		t.Fatalf("CreateTable: %v", err)
	}

	tx := tbl.NewTransaction()
	if err := tx.SetProperties(iceberg.Properties{"owner": "alice"}); err != nil {
		t.Fatalf("SetProperties: %v", err)
	}
	tbl2, err := tx.Commit(ctx)
	if err != nil {
		t.Fatalf("Commit: %v", err)
	}
	if tbl2.Properties()["owner"] != "alice" || tbl2.MetadataLocation() == tbl.MetadataLocation() {
		t.Fatalf("commit not applied: props %v, location %s", tbl2.Properties(), tbl2.MetadataLocation())
	}

	// A stale requirement surfaces as the client's retryable commit failure.
	_, _, err = cat.CommitTable(ctx, ident,
		[]table.Requirement{table.AssertCurrentSchemaID(99)},
		[]table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"x": "y"})})
	if !errors.Is(err, table.ErrCommitFailed) {
		t.Fatalf("stale commit err = %v, want table.ErrCommitFailed", err)
	}

	staged := table.Identifier{"outer", "inner", "staged"}
	st, err := cat.CreateTable(ctx, staged, catalogtest.Schema,
		icecat.WithStagedUpdates(table.NewSetPropertiesUpdate(iceberg.Properties{"staged": "yes"})))
	if err != nil {
		t.Fatalf("staged CreateTable: %v", err)
	}
	if st.Properties()["staged"] != "yes" {
		t.Fatalf("staged create lost its update: %v", st.Properties())
	}

	renamed := table.Identifier{"outer", "renamed"}
	if _, err := cat.RenameTable(ctx, ident, renamed); err != nil {
		t.Fatalf("RenameTable: %v", err)
	}
	if ok, _ := cat.CheckTableExists(ctx, ident); ok {
		t.Fatal("old name still exists after rename")
	}

	reg := table.Identifier{"outer", "registered"}
	regTbl, err := cat.RegisterTable(ctx, reg, tbl2.MetadataLocation())
	if err != nil {
		t.Fatalf("RegisterTable: %v", err)
	}
	if regTbl.Properties()["owner"] != "alice" {
		t.Fatalf("registered table has wrong metadata: %v", regTbl.Properties())
	}

	// Transactions are all or nothing: one stale change fails every change.
	cur, err := cat.LoadTable(ctx, renamed)
	if err != nil {
		t.Fatalf("LoadTable: %v", err)
	}
	err = cat.CommitTransaction(ctx, []table.TableCommit{
		{Identifier: renamed, Updates: []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"tx": "1"})}},
		{Identifier: reg, Requirements: []table.Requirement{table.AssertCurrentSchemaID(99)},
			Updates: []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"tx": "1"})}},
	})
	if !errors.Is(err, table.ErrCommitFailed) {
		t.Fatalf("stale transaction err = %v, want table.ErrCommitFailed", err)
	}
	if after, _ := cat.LoadTable(ctx, renamed); after.MetadataLocation() != cur.MetadataLocation() {
		t.Fatal("a failed transaction changed a table")
	}
	err = cat.CommitTransaction(ctx, []table.TableCommit{
		{Identifier: renamed, Requirements: []table.Requirement{table.AssertTableUUID(cur.Metadata().TableUUID())},
			Updates: []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"tx": "1"})}},
		{Identifier: reg, Updates: []table.Update{table.NewSetPropertiesUpdate(iceberg.Properties{"tx": "2"})}},
	})
	if err != nil {
		t.Fatalf("CommitTransaction: %v", err)
	}
	for id, want := range map[string]table.Identifier{"1": renamed, "2": reg} {
		got, err := cat.LoadTable(ctx, want)
		if err != nil || got.Properties()["tx"] != id {
			t.Fatalf("after transaction %v: %v, %v", want, got.Properties(), err)
		}
	}

	var listed []table.Identifier
	for id, err := range cat.ListTables(ctx, table.Identifier{"outer"}) {
		if err != nil {
			t.Fatalf("ListTables: %v", err)
		}
		listed = append(listed, id)
	}
	if len(listed) != 2 {
		t.Fatalf("ListTables(outer) = %v", listed)
	}
}

// TestClientViews covers the view endpoints through iceberg-go's REST client.
func TestClientViews(t *testing.T) {
	ctx := context.Background()
	_, hs := newTestServer(t, Options{})
	cat := newRESTClient(t, hs.URL)

	ns := table.Identifier{"db"}
	if err := cat.CreateNamespace(ctx, ns, nil); err != nil {
		t.Fatalf("CreateNamespace: %v", err)
	}
	ident := table.Identifier{"db", "v"}
	version, err := view.NewVersionFromSQL(1, 0, "SELECT 1 AS id", ns)
	if err != nil {
		t.Fatalf("NewVersionFromSQL: %v", err)
	}
	v, err := cat.CreateView(ctx, ident, version, catalogtest.Schema)
	if err != nil {
		t.Fatalf("CreateView: %v", err)
	}
	if _, err := cat.CreateView(ctx, ident, version, catalogtest.Schema); !errors.Is(err, icecat.ErrViewAlreadyExists) {
		t.Fatalf("duplicate CreateView err = %v", err)
	}
	if ok, err := cat.CheckViewExists(ctx, ident); err != nil || !ok {
		t.Fatalf("CheckViewExists = %v, %v", ok, err)
	}
	loaded, err := cat.LoadView(ctx, ident)
	if err != nil || loaded.MetadataLocation() != v.MetadataLocation() {
		t.Fatalf("LoadView = %v, %v", loaded, err)
	}

	replaced, err := cat.UpdateView(ctx, ident,
		[]view.Requirement{view.AssertViewUUID(v.Metadata().ViewUUID())},
		[]view.Update{view.NewSetPropertiesUpdate(iceberg.Properties{"comment": "hi"})})
	if err != nil {
		t.Fatalf("UpdateView: %v", err)
	}
	if replaced.Properties()["comment"] != "hi" || replaced.MetadataLocation() == v.MetadataLocation() {
		t.Fatalf("UpdateView not applied: %v %s", replaced.Properties(), replaced.MetadataLocation())
	}
	_, err = cat.UpdateView(ctx, ident,
		[]view.Requirement{view.AssertViewUUID([16]byte{1})},
		[]view.Update{view.NewSetPropertiesUpdate(iceberg.Properties{"comment": "stale"})})
	if !errors.Is(err, rest.ErrCommitFailed) {
		t.Fatalf("stale UpdateView err = %v, want rest.ErrCommitFailed", err)
	}

	moved := table.Identifier{"db", "v2"}
	if _, err := cat.RenameView(ctx, ident, moved); err != nil {
		t.Fatalf("RenameView: %v", err)
	}
	if _, err := cat.RenameView(ctx, ident, moved); !errors.Is(err, icecat.ErrNoSuchView) {
		t.Fatalf("RenameView of missing view err = %v", err)
	}
	var listed []table.Identifier
	for id, err := range cat.ListViews(ctx, ns) {
		if err != nil {
			t.Fatalf("ListViews: %v", err)
		}
		listed = append(listed, id)
	}
	if len(listed) != 1 || !slices.Equal(listed[0], moved) {
		t.Fatalf("ListViews = %v", listed)
	}

	regIdent := table.Identifier{"db", "v3"}
	if _, err := cat.RegisterView(ctx, regIdent, replaced.MetadataLocation()); err != nil {
		t.Fatalf("RegisterView: %v", err)
	}
	for _, id := range []table.Identifier{moved, regIdent} {
		if err := cat.DropView(ctx, id); err != nil {
			t.Fatalf("DropView %v: %v", id, err)
		}
	}
	if err := cat.DropView(ctx, moved); !errors.Is(err, icecat.ErrNoSuchView) {
		t.Fatalf("DropView of missing view err = %v", err)
	}
}
