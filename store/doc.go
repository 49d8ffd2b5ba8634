// Package store keeps the relay's own tables: the quarantine table, where
// events Kafka will never accept wait for an operator, and the cleanup of
// published outbox rows. It is the one place that derives those tables'
// names and quotes them into SQL; migrations creates the tables, replication
// streams from the outbox table, and neither runs this SQL.
package store
