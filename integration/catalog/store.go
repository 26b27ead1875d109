package catalog

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/apache/iceberg-go/table"
)

// iceberg-go v0.7.0's SQL catalog has no RegisterTable, no view rename or
// replace, and its LoadView does not report the metadata location the REST
// responses need. For those operations this file reads and writes the SQL
// catalog's own iceberg_tables rows directly, in the same format, so that
// the SQL catalog keeps seeing them (ListViews, DropView, LoadTable, ...).

const (
	rowTable = "TABLE"
	rowView  = "VIEW"
)

// errNoRow reports that no row of the wanted type exists.
var errNoRow = errors.New("no catalog row")

// rowLocation returns the metadata location stored for ident as kind.
func (s *Server) rowLocation(ctx context.Context, ident table.Identifier, kind string) (string, error) {
	ns, name := namespaceKey(ident[:len(ident)-1]), ident[len(ident)-1]
	var loc sql.NullString
	err := s.db.QueryRowContext(ctx,
		`SELECT metadata_location FROM iceberg_tables
		 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?
		   AND (iceberg_type = ? OR (iceberg_type IS NULL AND ? = 'TABLE'))`,
		s.opts.Name, ns, name, kind, kind).Scan(&loc)
	if errors.Is(err, sql.ErrNoRows) || (err == nil && !loc.Valid) {
		return "", errNoRow
	}
	if err != nil {
		return "", fmt.Errorf("reading catalog row for %s: %w", strings.Join(ident, "."), err)
	}

	return loc.String, nil
}

// rowKind reports whether ident is taken and by what kind of object.
func (s *Server) rowKind(ctx context.Context, ident table.Identifier) (string, bool, error) {
	ns, name := namespaceKey(ident[:len(ident)-1]), ident[len(ident)-1]
	var kind sql.NullString
	err := s.db.QueryRowContext(ctx,
		`SELECT iceberg_type FROM iceberg_tables
		 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?`,
		s.opts.Name, ns, name).Scan(&kind)
	if errors.Is(err, sql.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("reading catalog row for %s: %w", strings.Join(ident, "."), err)
	}
	if !kind.Valid {
		return rowTable, true, nil
	}

	return kind.String, true, nil
}

func (s *Server) insertRow(ctx context.Context, ident table.Identifier, kind, loc string) error {
	ns, name := namespaceKey(ident[:len(ident)-1]), ident[len(ident)-1]
	_, err := s.db.ExecContext(ctx,
		`INSERT INTO iceberg_tables (catalog_name, table_namespace, table_name, iceberg_type, metadata_location)
		 VALUES (?, ?, ?, ?, ?)`,
		s.opts.Name, ns, name, kind, loc)
	if err != nil {
		return fmt.Errorf("inserting catalog row for %s: %w", strings.Join(ident, "."), err)
	}

	return nil
}

// swapLocation moves ident's metadata pointer from oldLoc to newLoc only if
// it still points at oldLoc, the optimistic check every commit relies on.
func (s *Server) swapLocation(ctx context.Context, ident table.Identifier, kind, oldLoc, newLoc string) (bool, error) {
	ns, name := namespaceKey(ident[:len(ident)-1]), ident[len(ident)-1]
	res, err := s.db.ExecContext(ctx,
		`UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ?
		 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ?
		   AND metadata_location = ? AND (iceberg_type = ? OR (iceberg_type IS NULL AND ? = 'TABLE'))`,
		newLoc, oldLoc, s.opts.Name, ns, name, oldLoc, kind, kind)
	if err != nil {
		return false, fmt.Errorf("updating catalog row for %s: %w", strings.Join(ident, "."), err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, err
	}

	return n == 1, nil
}

func (s *Server) renameRow(ctx context.Context, from, to table.Identifier, kind string) (bool, error) {
	res, err := s.db.ExecContext(ctx,
		`UPDATE iceberg_tables SET table_namespace = ?, table_name = ?
		 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? AND iceberg_type = ?`,
		namespaceKey(to[:len(to)-1]), to[len(to)-1],
		s.opts.Name, namespaceKey(from[:len(from)-1]), from[len(from)-1], kind)
	if err != nil {
		return false, fmt.Errorf("renaming %s: %w", strings.Join(from, "."), err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, err
	}

	return n == 1, nil
}
