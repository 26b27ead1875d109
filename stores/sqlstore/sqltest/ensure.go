package sqltest

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ensureTimeout bounds an Ensure call, connecting included.
const ensureTimeout = 10 * time.Second

// EnsurePostgres connects to the PostgreSQL database dsn names, creating
// the database first when the server says it does not exist.
func EnsurePostgres(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, ensureTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err == nil {
		return conn.Close(ctx)
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "3D000" { // invalid_catalog_name
		return err
	}
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return err
	}
	name := cfg.Database
	cfg.Database = "postgres"
	admin, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	_, err = admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // created meanwhile
		err = nil
	}
	return err
}

// EnsureMySQL connects to the MySQL/MariaDB database dsn names, creating
// the database first when the server says it does not exist. Its errors
// never echo the DSN, which may hold a password.
func EnsureMySQL(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, ensureTimeout)
	defer cancel()
	mc, err := mysql.ParseDSN(dsn)
	if err != nil {
		return errors.New("unparsable MySQL DSN")
	}
	mc.Timeout = 5 * time.Second
	err = pingMySQL(ctx, mc)
	var me *mysql.MySQLError
	if !errors.As(err, &me) || me.Number != 1049 { // ER_BAD_DB_ERROR
		return err
	}
	name := mc.DBName
	mc.DBName = ""
	connector, err := mysql.NewConnector(mc)
	if err != nil {
		return err
	}
	db := sql.OpenDB(connector)
	defer db.Close()
	_, err = db.ExecContext(ctx, "CREATE DATABASE IF NOT EXISTS `"+strings.ReplaceAll(name, "`", "``")+"`")
	return err
}

func pingMySQL(ctx context.Context, mc *mysql.Config) error {
	connector, err := mysql.NewConnector(mc)
	if err != nil {
		return err
	}
	db := sql.OpenDB(connector)
	defer db.Close()
	return db.PingContext(ctx)
}
